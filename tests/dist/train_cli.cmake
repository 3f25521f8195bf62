# `kiln train` on two processes (mpirun -np 2, CPU): the run ends, only rank 0's files exist
# and hold one row per epoch, the job resumes from rank 0's checkpoint on every rank, `kiln
# eval` on two processes (each on half the test set, counts summed) reports what one process
# does, a global batch that does not split evenly is one clear error, and --no-sync-bn trains.
# MPIRUN is the launcher with '|' between arguments; KILN the CLI; OUT a scratch folder.
string(REPLACE "|" ";" mpirun "${MPIRUN}")
set(common --model cnn --data synthetic --synthetic-size 100 --max-steps 3 --batch-size 8 --progress none
           --workers 1 --device cpu)
function(run expect_ok)
  execute_process(COMMAND ${mpirun} ${KILN} train ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 120)
  message("$ kiln train ${ARGN}\n${out}${err}")
  if(rc MATCHES "timeout")
    message(FATAL_ERROR "kiln train hung")
  endif()
  if(expect_ok AND NOT rc EQUAL 0)
    message(FATAL_ERROR "kiln train failed (${rc})")
  elseif(NOT expect_ok AND rc EQUAL 0)
    message(FATAL_ERROR "kiln train succeeded but should have failed")
  endif()
  set(output "${out}${err}" PARENT_SCOPE)
endfunction()
function(expect_rows file n)
  file(STRINGS ${file} lines)
  list(LENGTH lines got)
  if(NOT got EQUAL n)
    message(FATAL_ERROR "${file} has ${got} lines, expected ${n}")
  endif()
endfunction()

file(REMOVE_RECURSE ${OUT})
run(TRUE --epochs 2 --output ${OUT}/run)
foreach(f metrics.csv metrics.jsonl last.safetensors summary.json)
  if(NOT EXISTS ${OUT}/run/${f})
    message(FATAL_ERROR "rank 0 wrote no ${f}")
  endif()
endforeach()
expect_rows(${OUT}/run/metrics.csv 3)  # header + 2 epochs: rank 1 wrote nothing into it
string(REGEX MATCHALL "done: 2 epochs" done "${output}")
list(LENGTH done printed)
if(NOT printed EQUAL 1)
  message(FATAL_ERROR "the summary was printed ${printed} times; only rank 0 prints it")
endif()
# A longer schedule than the checkpoint's: --resume-override says the change is meant.
run(TRUE --epochs 3 --resume-override --output ${OUT}/run --resume ${OUT}/run/last.safetensors)
expect_rows(${OUT}/run/metrics.csv 4)
# Evaluation: 20 test samples, 10 per rank; the summed counts give one process's percentages.
set(eval_args eval --model cnn --data synthetic --synthetic-size 100 --batch-size 8 --workers 1 --device cpu
              --weights ${OUT}/run/last.safetensors)
execute_process(COMMAND ${KILN} ${eval_args} RESULT_VARIABLE rc1 OUTPUT_VARIABLE one ERROR_VARIABLE err1 TIMEOUT 120)
execute_process(COMMAND ${mpirun} ${KILN} ${eval_args} RESULT_VARIABLE rc2 OUTPUT_VARIABLE two ERROR_VARIABLE err2
                TIMEOUT 120)
message("$ kiln eval: one process: ${one}${err1}two processes: ${two}${err2}")
string(REGEX MATCH "test top-1 [0-9.]+%, top-5 [0-9.]+%" one_acc "${one}")
string(REGEX MATCH "test top-1 [0-9.]+%, top-5 [0-9.]+%" two_acc "${two}")
if(NOT rc1 EQUAL 0 OR NOT rc2 EQUAL 0 OR one_acc STREQUAL "" OR NOT one_acc STREQUAL two_acc)
  message(FATAL_ERROR "evaluation on two processes ('${two_acc}') differs from one ('${one_acc}')")
endif()
run(FALSE --epochs 1 --output ${OUT}/odd --batch-size 7)
if(NOT output MATCHES "must split evenly over the 2 processes")
  message(FATAL_ERROR "no clear error for a batch that does not split")
endif()
run(TRUE --epochs 1 --output ${OUT}/per_rank_bn --no-sync-bn)
message("ok")
