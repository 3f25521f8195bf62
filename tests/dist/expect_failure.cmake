# Runs a command that must fail: a non-zero exit status within LIMIT seconds (a hang is the
# bug this guards against), with EXPECT (a regular expression, may be empty) in its output.
# CMD is the command with '|' between arguments.
string(REPLACE "|" ";" cmd "${CMD}")
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT ${LIMIT})
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
message("${out}${err}")
if(rc MATCHES "timeout" OR took GREATER_EQUAL LIMIT)
  message(FATAL_ERROR "the job hung: still running after ${LIMIT} s (${rc})")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the job succeeded, but a rank failed on purpose: it must end with a non-zero status")
endif()
if(NOT "${EXPECT}" STREQUAL "" AND NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output does not say '${EXPECT}'")
endif()
message("ok: exit status ${rc} after ${took} s")
