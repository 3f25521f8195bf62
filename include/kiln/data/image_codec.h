// JPEG (libjpeg's jpeglib API, which libjpeg-turbo implements; not the TurboJPEG API, which
// some machines lack) and PNG (libpng) decoding from memory into 8-bit HWC images, plus the
// matching encoders (tests write fixture trees with them; tools can dump images).
//
// Decoding never aborts the process: libjpeg's and libpng's fatal errors are caught with
// setjmp/longjmp and become Error(Data) naming `what`. A JPEG that ends early (libjpeg's
// "premature end of data" warning, which would otherwise fill the rest with grey) counts as
// corrupt too; libjpeg's other warnings (e.g. extraneous bytes before a marker, common in
// ImageNet) are tolerated, as PIL tolerates them.
//
// Channel conversion follows PIL's convert(): to 3 channels, grey is replicated; to 1 channel,
// colour becomes luma 0.299 R + 0.587 G + 0.114 B; alpha is dropped without compositing;
// CMYK/YCCK JPEGs are converted (Adobe's inverted CMYK convention); 16-bit PNGs are scaled to 8.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/data/dataset.h"
#include "kiln/data/sample_geometry.h"

namespace kiln {

enum class ImageFormat { Unknown, Jpeg, Png };

// By magic bytes (FF D8 FF for JPEG, the 8-byte PNG signature), not by file name.
ImageFormat sniff_image_format(const uint8_t* bytes, size_t size);

// channels: 1 or 3. Images of more than max_pixels are refused as corrupt before any pixel
// memory is allocated, so that a forged header cannot make a worker allocate gigabytes. The
// default, 64 Mpixel (192 MB decoded as RGB), is far above any training image; a worker
// per core decoding 2^28-pixel files at once would need gigabytes each (--max-image-pixels).
inline constexpr int64_t kMaxDecodePixels = int64_t{1} << 26;
Image decode_jpeg(const uint8_t* bytes, size_t size, int64_t channels, const std::string& what,
                  int64_t max_pixels = kMaxDecodePixels);
Image decode_png(const uint8_t* bytes, size_t size, int64_t channels, const std::string& what,
                 int64_t max_pixels = kMaxDecodePixels);
Image decode_image(const uint8_t* bytes, size_t size, int64_t channels, const std::string& what,
                   int64_t max_pixels = kMaxDecodePixels);

// What a file's header says, read without decoding pixels (the GPU path draws each sample's
// geometry from it, and routes what nvJPEG cannot take to the host decoder).
struct ImageInfo {
  ImageFormat format = ImageFormat::Unknown;
  int64_t height = 0, width = 0;
  int64_t channels = 0;      // as stored: 1, 3 or 4 (CMYK / YCCK JPEG, RGBA PNG); 2: grey+alpha PNG
  bool progressive = false;  // JPEG
  bool cmyk = false;         // JPEG in CMYK or YCCK
  // The bytes end with the EOI marker, trailing zero padding ignored (a truncated file does
  // not); PNG: with the IEND chunk.
  bool complete = false;
};
// Error(Data) naming `what` for a file that is neither JPEG nor PNG or whose header is corrupt.
ImageInfo read_image_info(const uint8_t* bytes, size_t size, const std::string& what);

// Decodes just what `g` reads, at libjpeg's smallest DCT scale that keeps its detail
// (dct_scale_for) and only the rows and columns of its window (jpeg_crop_scanline,
// jpeg_skip_scanlines), then resamples into out (g.out_h() x g.out_w() x channels bytes). `g`
// refers to the full-size image (InvalidArgument when the file is another size). PNGs and
// CMYK JPEGs decode whole, then resample. Errors as decode_image; decoding stops after the
// window's last row when the data ends with EOI, else it runs to the end so that truncation is
// still caught. dct_scaling / crop = false decode the full image (tests compare the two).
struct ResampledDecodeOptions {
  bool dct_scaling = true;
  bool crop = true;
  bool tight_margin = true;  // KILN_JPEG_TIGHT_MARGIN
  bool batch_rows = true;    // KILN_JPEG_BATCH_ROWS
  // Progressive JPEGs: each scan entropy-decoded only down to the window (with crop, for data
  // that ends with EOI).
  bool progressive_stop = true;  // KILN_JPEG_PROGRESSIVE_STOP
  int64_t max_pixels = kMaxDecodePixels;
  ResampleOrder resample = ResampleOrder::vertical_first;  // KILN_RESAMPLE_VERTICAL_FIRST
  ResampleMath math = ResampleMath::fixed16;               // KILN_RESAMPLE_FIXED_POINT
};
void decode_resampled(const uint8_t* bytes, size_t size, int64_t channels, const SampleGeometry& g,
                      uint8_t* out, const std::string& what, const ResampledDecodeOptions& o = {});

// quality 1..100; images of 1 (grey), 3 (RGB) or 4 channels. Four channels are written as CMYK
// with an Adobe marker, which readers take as Adobe's inverted CMYK: store 255 - ink.
// Options: a progressive scan script (jpeg_simple_progression) and the chroma subsampling of
// colour images (libjpeg's default is 4:2:0).
enum class JpegSubsampling { s444, s422, s420 };
struct JpegEncodeOptions {
  bool progressive = false;
  JpegSubsampling subsampling = JpegSubsampling::s420;
};
std::vector<uint8_t> encode_jpeg(const Image& image, int quality, const JpegEncodeOptions& o = {});
// 1, 2 (grey+alpha), 3 or 4 (RGBA) channels, 8-bit, lossless.
std::vector<uint8_t> encode_png(const Image& image);

}  // namespace kiln
