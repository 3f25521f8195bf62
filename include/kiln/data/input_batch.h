// What the input pipeline hands the backend, in the form that moves fewest bytes: uint8 pixels
// (normalised and cast on the device), or, where the backend decodes JPEGs itself (nvJPEG), the
// files' bytes with each sample's geometry. The data layer fills these; backends read them.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/data/sample_augment.h"
#include "kiln/data/sample_geometry.h"

namespace kiln {

// Per-channel statistics of [0,1] pixels: x = (p / 255 - mean) / std, applied where the batch
// lands (the device, or the CPU backend's staging pass).
struct InputNormalization {
  std::vector<float> mean;
  std::vector<float> std;
};

// How images are decoded: the CLI's --decode. auto: on the GPU when the build and the device
// can (nvJPEG), else on the host.
enum class DecodeWhere { automatic, gpu, cpu };
const char* decode_where_name(DecodeWhere d);
DecodeWhere parse_decode_where(const std::string& s);  // "auto", "gpu", "cpu"; else InvalidArgument

// One sample of an encoded batch: either a JPEG's bytes and the geometry to cut from it, or
// (empty bytes) its final pixels decoded on the host, at EncodedBatch::host_pixels + k * sample.
struct EncodedImage {
  std::vector<uint8_t> bytes;
  SampleGeometry geometry;
  std::string name;  // the file, for messages
  // Applied after the geometry, where the batch lands (host-decoded samples too).
  SampleAugment augment;
};

struct EncodedBatch {
  int64_t size = 0;   // valid samples (the rest of a partial batch are zero, label -1)
  int64_t batch = 0;  // the compiled batch
  int64_t height = 0, width = 0, channels = 0;  // of each output sample
  std::vector<EncodedImage> images;             // `size` entries
  std::vector<uint8_t> host_pixels;             // batch * height * width * channels
  std::vector<int32_t> labels;                  // `batch` entries
  // Decodes sample k on the host into `out` (height x width x channels), for an image the
  // device decoder refused; may replace the file by the next good one as the dataset does, and
  // then sets *label to that file's label.
  std::function<void(int64_t k, uint8_t* out, int32_t* label)> host_decode;

  int64_t sample_bytes() const { return height * width * channels; }
};

// What a backend's JPEG decoder did, summed since it was made (kiln's summary reports it).
struct DecodeCounters {
  int64_t hardware = 0;    // images decoded on the JPEG engines
  int64_t gpu_hybrid = 0;  // on the GPU's CUDA cores (nvJPEG's hybrid / GPU backend)
  int64_t host = 0;        // decoded on the host: not JPEG, CMYK, or refused by nvJPEG
  int64_t batches = 0;     // encoded batches staged
  // Host seconds the staging thread spent in those batches (what it cannot spend enqueuing
  // steps): in all, and in its parts.
  double stage_seconds = 0;        // the whole stage_batch_encoded call
  double copy_seconds = 0;         // bitstreams into pinned memory
  double parse_seconds = 0;        // headers, the engines' support checks, the plan
  double engine_call_seconds = 0;  // inside nvjpegDecodeBatched(Ex)
  double hybrid_seconds = 0;       // the hybrid decoder's images (host Huffman)
  double host_decode_seconds = 0;  // images decoded or copied from the host
  // Host batches (floats or uint8: stage_batch, stage_batch_u8) and the seconds spent copying
  // them into pinned memory (KILN_STAGE_COPY_THREADS threads), before their transfer is queued.
  int64_t host_batches = 0;
  double host_copy_seconds = 0;
};

}  // namespace kiln
