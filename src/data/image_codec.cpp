// JPEG and PNG codecs over memory buffers. libjpeg and libpng report fatal errors by calling
// a handler that must not return; ours longjmp back to the setjmp in the decode function. Only
// plain data lives in those functions' frames: everything written after setjmp sits in a struct
// owned by the caller (a longjmp must not skip a destructor, and locals changed after setjmp are
// indeterminate after it), and the C++ exception is thrown only after the library is cleaned up.
#include "kiln/data/image_codec.h"

// Order matters: jpeglib.h needs FILE and size_t declared first, jerror.h needs jpeglib.h.
// clang-format off
#include <png.h>
#include <setjmp.h>
#include <stdio.h>
#include <jpeglib.h>
#include <jerror.h>
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "jpeg_progressive.h"
#include "kiln/core/error.h"

// jpeg_crop_scanline and jpeg_skip_scanlines: libjpeg-turbo 1.5 and later. Elsewhere the
// cropped decode reads (and drops) the rows above the window and decodes full rows.
#if defined(LIBJPEG_TURBO_VERSION_NUMBER) && LIBJPEG_TURBO_VERSION_NUMBER >= 1005000
#define KILN_JPEG_CROP 1
#else
#define KILN_JPEG_CROP 0
#endif

namespace kiln {
namespace {

// PIL's luma: L = (19595 R + 38470 G + 7471 B + 0x8000) >> 16 (0.299, 0.587, 0.114).
uint8_t luma(uint8_t r, uint8_t g, uint8_t b) {
  return static_cast<uint8_t>((19595u * r + 38470u * g + 7471u * b + 0x8000u) >> 16);
}

// Converts 1, 3 or 4 (CMYK) decoded channels to the requested 1 or 3.
void convert_channels(const uint8_t* src, int64_t pixels, int64_t src_channels, bool adobe_cmyk,
                      int64_t channels, uint8_t* dst) {
  for (int64_t p = 0; p < pixels; ++p) {
    const uint8_t* s = src + p * src_channels;
    uint8_t rgb[3];
    if (src_channels == 1) {
      rgb[0] = rgb[1] = rgb[2] = s[0];
    } else if (src_channels == 3) {
      rgb[0] = s[0], rgb[1] = s[1], rgb[2] = s[2];
    } else {  // CMYK as PIL converts it; Adobe writes it inverted
      for (int c = 0; c < 3; ++c) {
        const unsigned v = adobe_cmyk ? s[c] * unsigned{s[3]} : (255u - s[c]) * (255u - s[3]);
        rgb[c] = static_cast<uint8_t>((v + 127) / 255);
      }
    }
    if (channels == 1) {
      dst[p] = src_channels == 1 ? s[0] : luma(rgb[0], rgb[1], rgb[2]);
    } else {
      std::memcpy(dst + 3 * p, rgb, 3);
    }
  }
}

void check_channels(int64_t channels) {
  KILN_CHECK(channels == 1 || channels == 3, InvalidArgument,
             "images can be decoded to 1 or 3 channels, not ", channels);
}

// ---- JPEG ---------------------------------------------------------------------------------

struct JpegErrorMgr {
  jpeg_error_mgr mgr;
  jmp_buf jump;
  bool truncated;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegErrorMgr*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

void jpeg_on_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  auto* err = reinterpret_cast<JpegErrorMgr*>(cinfo->err);
  if (cinfo->err->msg_code == JWRN_JPEG_EOF) err->truncated = true;
  cinfo->err->num_warnings++;
}

// A memory source written here rather than jpeg_mem_src, which libjpeg 6b builds lack.
void src_init(j_decompress_ptr) {}
boolean src_fill(j_decompress_ptr cinfo) {
  // Out of data: warn (we mark the image truncated) and feed a fake end-of-image marker, as
  // libjpeg's own sources do, so the decoder stops cleanly.
  static const JOCTET kEoi[2] = {0xFF, JPEG_EOI};
  cinfo->err->msg_code = JWRN_JPEG_EOF;
  (*cinfo->err->emit_message)(reinterpret_cast<j_common_ptr>(cinfo), -1);
  cinfo->src->next_input_byte = kEoi;
  cinfo->src->bytes_in_buffer = 2;
  return TRUE;
}
void src_skip(j_decompress_ptr cinfo, long n) {
  if (n <= 0) return;
  while (static_cast<size_t>(n) > cinfo->src->bytes_in_buffer) {
    n -= static_cast<long>(cinfo->src->bytes_in_buffer);
    src_fill(cinfo);
  }
  cinfo->src->next_input_byte += n;
  cinfo->src->bytes_in_buffer -= static_cast<size_t>(n);
}
void src_term(j_decompress_ptr) {}

struct JpegDecodeState {
  jpeg_decompress_struct cinfo;
  JpegErrorMgr err;
  jpeg_source_mgr src;
  std::vector<uint8_t> raw;  // as decoded: 1, 3 or 4 channels
  int64_t height = 0, width = 0, raw_channels = 0;
  bool adobe = false;
  bool too_large = false;
};

// Error handlers and the memory source, before setjmp and jpeg_create_decompress.
void jpeg_setup(const uint8_t* bytes, size_t size, jpeg_decompress_struct& cinfo, JpegErrorMgr& err,
                jpeg_source_mgr& src) {
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_on_error;
  err.mgr.emit_message = jpeg_on_message;
  err.truncated = false;
  err.message[0] = '\0';
  src.init_source = src_init;
  src.fill_input_buffer = src_fill;
  src.skip_input_data = src_skip;
  src.resync_to_restart = jpeg_resync_to_restart;
  src.term_source = src_term;
  src.next_input_byte = bytes;
  src.bytes_in_buffer = size;
}

// Returns false with st.err.message set on failure.
bool jpeg_decode_raw(const uint8_t* bytes, size_t size, int64_t max_pixels, JpegDecodeState& st) {
  jpeg_setup(bytes, size, st.cinfo, st.err, st.src);
  if (setjmp(st.err.jump)) {
    jpeg_destroy_decompress(&st.cinfo);
    return false;
  }
  jpeg_create_decompress(&st.cinfo);
  st.cinfo.src = &st.src;
  jpeg_read_header(&st.cinfo, TRUE);
  const J_COLOR_SPACE in = st.cinfo.jpeg_color_space;
  // Grey stays grey and CMYK/YCCK come out as CMYK: we convert those ourselves because not every
  // libjpeg can (6b has no grey->RGB, none has CMYK->RGB).
  st.cinfo.out_color_space = in == JCS_GRAYSCALE                  ? JCS_GRAYSCALE
                             : (in == JCS_CMYK || in == JCS_YCCK) ? JCS_CMYK
                                                                  : JCS_RGB;
  st.adobe = st.cinfo.saw_Adobe_marker;
  if (int64_t{st.cinfo.image_width} * st.cinfo.image_height > max_pixels) {
    st.too_large = true;
    st.width = st.cinfo.image_width;
    st.height = st.cinfo.image_height;
    jpeg_destroy_decompress(&st.cinfo);
    return false;
  }
  jpeg_start_decompress(&st.cinfo);
  st.height = st.cinfo.output_height;
  st.width = st.cinfo.output_width;
  st.raw_channels = st.cinfo.output_components;
  const size_t stride = static_cast<size_t>(st.width * st.raw_channels);
  st.raw.resize(stride * static_cast<size_t>(st.height));
  while (st.cinfo.output_scanline < st.cinfo.output_height) {
    JSAMPROW row = st.raw.data() + stride * st.cinfo.output_scanline;
    jpeg_read_scanlines(&st.cinfo, &row, 1);
  }
  jpeg_finish_decompress(&st.cinfo);
  jpeg_destroy_decompress(&st.cinfo);
  return true;
}

// Whether the bytes end with the EOI marker, ignoring the zero padding some writers append.
bool ends_with_eoi(const uint8_t* bytes, size_t size) {
  while (size > 0 && bytes[size - 1] == 0) --size;
  return size >= 2 && bytes[size - 2] == 0xFF && bytes[size - 1] == JPEG_EOI;
}

struct JpegInfoState {
  jpeg_decompress_struct cinfo;
  JpegErrorMgr err;
  jpeg_source_mgr src;
  int64_t height = 0, width = 0, components = 0;
  bool progressive = false, cmyk = false;
};

bool jpeg_read_info(const uint8_t* bytes, size_t size, JpegInfoState& st) {
  jpeg_setup(bytes, size, st.cinfo, st.err, st.src);
  if (setjmp(st.err.jump)) {
    jpeg_destroy_decompress(&st.cinfo);
    return false;
  }
  jpeg_create_decompress(&st.cinfo);
  st.cinfo.src = &st.src;
  jpeg_read_header(&st.cinfo, TRUE);
  st.height = st.cinfo.image_height;
  st.width = st.cinfo.image_width;
  st.components = st.cinfo.num_components;
  st.progressive = st.cinfo.progressive_mode;
  st.cmyk = st.cinfo.jpeg_color_space == JCS_CMYK || st.cinfo.jpeg_color_space == JCS_YCCK;
  jpeg_destroy_decompress(&st.cinfo);
  return true;
}

// The cropped, DCT-scaled decode: only plain data and pointers here (see the file's comment);
// the window's pixels go to a buffer the caller owns.
struct JpegWindowState {
  jpeg_decompress_struct cinfo;
  JpegErrorMgr err;
  jpeg_source_mgr src;
  std::vector<uint8_t>* raw = nullptr;             // the window: rows x width x raw_channels
  int64_t image_h = 0, image_w = 0;                // the full-size image
  int64_t scaled_h = 0, scaled_w = 0;              // after DCT scaling
  int64_t top = 0, left = 0, rows = 0, width = 0;  // the decoded window, scaled coordinates
  int64_t raw_channels = 0;
  bool cmyk = false;  // left to the full decode
  bool too_large = false;
  bool size_mismatch = false;                  // the geometry refers to another size
  static constexpr int64_t kRowsPerCall = 16;  // libjpeg's largest row group
  JSAMPROW rows_out[kRowsPerCall] = {};
};

// Reads the window of `want` (scaled coordinates, computed by `plan` once the scaled size is
// known) and stops. Returns false with st.err.message set on failure.
struct WindowPlan {
  const SampleGeometry* g;
  bool dct_scaling, crop, tight_margin, batch_rows, progressive_stop;
  int64_t max_pixels;
  SampleGeometry scaled;  // g on the scaled image
};

bool jpeg_decode_window(const uint8_t* bytes, size_t size, WindowPlan& plan, JpegWindowState& st) {
  jpeg_setup(bytes, size, st.cinfo, st.err, st.src);
  if (setjmp(st.err.jump)) {
    jpeg_destroy_decompress(&st.cinfo);
    return false;
  }
  jpeg_create_decompress(&st.cinfo);
  st.cinfo.src = &st.src;
  jpeg_read_header(&st.cinfo, TRUE);
  st.image_h = st.cinfo.image_height;
  st.image_w = st.cinfo.image_width;
  const J_COLOR_SPACE in = st.cinfo.jpeg_color_space;
  st.cmyk = in == JCS_CMYK || in == JCS_YCCK;
  st.too_large = st.image_h * st.image_w > plan.max_pixels;
  st.size_mismatch = st.image_h != plan.g->src_h || st.image_w != plan.g->src_w;
  if (st.cmyk || st.too_large || st.size_mismatch) {
    jpeg_destroy_decompress(&st.cinfo);
    return true;
  }
  st.cinfo.out_color_space = in == JCS_GRAYSCALE ? JCS_GRAYSCALE : JCS_RGB;
  st.cinfo.quantize_colors = FALSE;
  const int m = plan.dct_scaling ? dct_scale_for(*plan.g) : 8;
  st.cinfo.scale_num = static_cast<unsigned>(m);
  st.cinfo.scale_denom = 8;
  jpeg_calc_output_dimensions(&st.cinfo);
  st.scaled_h = st.cinfo.output_height;
  st.scaled_w = st.cinfo.output_width;
  // libjpeg-turbo gives ceil(size * M / 8) with the exact factor M / 8; a library that rounds
  // the scale to one it supports gets the factor of the size it produced.
  if (st.scaled_h == (st.image_h * m + 7) / 8 && st.scaled_w == (st.image_w * m + 7) / 8) {
    plan.scaled = rescale_source_dct(*plan.g, m);
  } else {
    plan.scaled = rescale_source(*plan.g, st.scaled_h, st.scaled_w);
  }
  SourceWindow win =
      plan.crop ? source_window(plan.scaled) : SourceWindow{0, 0, st.scaled_h, st.scaled_w};
  if (win.height <= 0 || win.width <= 0) win = {0, 0, 1, 1};  // nothing read: decode a pixel
#if KILN_JPEG_CROP
  // Progressive files decode every scan before the first row comes out; the rows below the
  // window need not be. Only for data that ends with EOI (else decoded to the end, below).
  const bool stop_scans =
      plan.crop && plan.progressive_stop && st.cinfo.progressive_mode && ends_with_eoi(bytes, size);
  st.cinfo.buffered_image = stop_scans;
  jpeg_start_decompress(&st.cinfo);
  if (stop_scans) {
#if JPEG_LIB_VERSION >= 70
    const int64_t imcu = st.cinfo.max_v_samp_factor * st.cinfo.min_DCT_v_scaled_size;
#else
    const int64_t imcu = st.cinfo.max_v_samp_factor * st.cinfo.min_DCT_scaled_size;
#endif
    // Two iMCU rows past the one holding the window's last row: the fancy upsampler's context
    // row and block smoothing's two block rows below (chroma has one block row an iMCU row).
    const int64_t last = (win.top + win.height - 1) / std::max<int64_t>(1, imcu);
    consume_progressive(st.cinfo, static_cast<unsigned>(last + 3));
    jpeg_start_output(&st.cinfo, st.cinfo.input_scan_number);
  }
#else
  jpeg_start_decompress(&st.cinfo);
#endif
  st.raw_channels = st.cinfo.output_components;
  // Fancy (smooth) chroma upsampling replicates the edge chroma sample of a cropped region
  // where the full decode sees the neighbouring one, which changes the region's outermost pixel
  // column on each side only; a margin of 2 pixels keeps those out of the window (tight_margin
  // off: one iMCU, 16 pixels, as before).
  const int64_t margin = !plan.crop ? 0 : plan.tight_margin ? 2 : 16;
  const int64_t x0 = std::max<int64_t>(0, win.left - margin);
  const int64_t x1 = std::min<int64_t>(st.cinfo.output_width, win.left + win.width + margin);
  JDIMENSION xoff = static_cast<JDIMENSION>(x0), width = static_cast<JDIMENSION>(x1 - x0);
#if KILN_JPEG_CROP
  // Widens the window to iMCU columns: the returned offset and width are what is decoded.
  if (plan.crop && (xoff != 0 || width != st.cinfo.output_width)) {
    jpeg_crop_scanline(&st.cinfo, &xoff, &width);
  }
  if (win.top > 0) jpeg_skip_scanlines(&st.cinfo, static_cast<JDIMENSION>(win.top));
#else
  xoff = 0, width = st.cinfo.output_width;
#endif
  st.left = xoff;
  st.width = width;
  const size_t full_stride = static_cast<size_t>(st.cinfo.output_width) * st.raw_channels;
  const size_t stride = static_cast<size_t>(st.width * st.raw_channels);
  // Grown only: resize() down and up again would zero-fill the difference for every image.
  const size_t raw_size = std::max(stride, full_stride) * static_cast<size_t>(win.height + 1);
  if (st.raw->size() < raw_size) st.raw->resize(raw_size);
  // Rows above the window (only where the library cannot skip them) are read and overwritten.
  while (static_cast<int64_t>(st.cinfo.output_scanline) < win.top) {
    JSAMPROW row = st.raw->data();
    jpeg_read_scanlines(&st.cinfo, &row, 1);
  }
  st.top = st.cinfo.output_scanline;
  const int64_t bottom = win.top + win.height;
  // Several rows a call: libjpeg upsamples a row group (2 rows for 4:2:0) at a time and, asked
  // for one row, goes through a spare row buffer and a copy.
  const int64_t per_call = plan.batch_rows ? JpegWindowState::kRowsPerCall : 1;
  while (static_cast<int64_t>(st.cinfo.output_scanline) < bottom) {
    const int64_t at = st.cinfo.output_scanline;
    const int64_t n = std::min(per_call, bottom - at);
    for (int64_t i = 0; i < n; ++i) st.rows_out[i] = st.raw->data() + stride * (at + i - st.top);
    jpeg_read_scanlines(&st.cinfo, st.rows_out, static_cast<JDIMENSION>(n));
  }
  st.rows = st.cinfo.output_scanline - st.top;
  if (st.cinfo.output_scanline < st.cinfo.output_height && !ends_with_eoi(bytes, size)) {
    // Stopping early would miss a truncation past the window: the data does not end with EOI
    // (truncated, or trailing bytes), so decode on to the end, where libjpeg can tell.
    // (Skipping to the very end would not read the data: skip all but the last row, read it.)
#if KILN_JPEG_CROP
    const JDIMENSION rest = st.cinfo.output_height - st.cinfo.output_scanline;
    if (rest > 1) jpeg_skip_scanlines(&st.cinfo, rest - 1);
#endif
    while (st.cinfo.output_scanline < st.cinfo.output_height) {
      JSAMPROW row = st.raw->data() + stride * static_cast<size_t>(win.height);
      jpeg_read_scanlines(&st.cinfo, &row, 1);
    }
  }
  if (st.cinfo.output_scanline >= st.cinfo.output_height && !st.cinfo.buffered_image) {
    jpeg_finish_decompress(&st.cinfo);
  } else {  // buffered-image mode consumed the data to its EOI already
    jpeg_abort_decompress(&st.cinfo);
  }
  jpeg_destroy_decompress(&st.cinfo);
  return true;
}

struct JpegDest {
  jpeg_destination_mgr mgr;
  std::vector<uint8_t>* out;
};
void dest_init(j_compress_ptr cinfo) {
  auto* d = reinterpret_cast<JpegDest*>(cinfo->dest);
  d->out->resize(1 << 16);
  d->mgr.next_output_byte = d->out->data();
  d->mgr.free_in_buffer = d->out->size();
}
boolean dest_empty(j_compress_ptr cinfo) {
  auto* d = reinterpret_cast<JpegDest*>(cinfo->dest);
  const size_t used = d->out->size();  // the whole buffer is full when this is called
  d->out->resize(used * 2);
  d->mgr.next_output_byte = d->out->data() + used;
  d->mgr.free_in_buffer = d->out->size() - used;
  return TRUE;
}
void dest_term(j_compress_ptr cinfo) {
  auto* d = reinterpret_cast<JpegDest*>(cinfo->dest);
  d->out->resize(d->out->size() - d->mgr.free_in_buffer);
}

struct JpegEncodeState {
  jpeg_compress_struct cinfo;
  JpegErrorMgr err;
  JpegDest dest;
  std::vector<uint8_t> out;
};

bool jpeg_encode_raw(const Image& image, int quality, const JpegEncodeOptions& o,
                     JpegEncodeState& st) {
  st.cinfo.err = jpeg_std_error(&st.err.mgr);
  st.err.mgr.error_exit = jpeg_on_error;
  st.err.mgr.emit_message = jpeg_on_message;
  st.err.message[0] = '\0';
  if (setjmp(st.err.jump)) {
    jpeg_destroy_compress(&st.cinfo);
    return false;
  }
  jpeg_create_compress(&st.cinfo);
  st.dest.mgr.init_destination = dest_init;
  st.dest.mgr.empty_output_buffer = dest_empty;
  st.dest.mgr.term_destination = dest_term;
  st.dest.out = &st.out;
  st.cinfo.dest = &st.dest.mgr;
  st.cinfo.image_width = static_cast<JDIMENSION>(image.width);
  st.cinfo.image_height = static_cast<JDIMENSION>(image.height);
  st.cinfo.input_components = static_cast<int>(image.channels);
  st.cinfo.in_color_space = image.channels == 1   ? JCS_GRAYSCALE
                            : image.channels == 3 ? JCS_RGB
                                                  : JCS_CMYK;
  jpeg_set_defaults(&st.cinfo);
  jpeg_set_quality(&st.cinfo, quality, TRUE);
  if (image.channels == 3) {  // the luma's sampling factors; chroma stays 1x1
    const int h = o.subsampling == JpegSubsampling::s444 ? 1 : 2;
    const int v = o.subsampling == JpegSubsampling::s420 ? 2 : 1;
    st.cinfo.comp_info[0].h_samp_factor = h;
    st.cinfo.comp_info[0].v_samp_factor = v;
  }
  if (o.progressive) jpeg_simple_progression(&st.cinfo);
  jpeg_start_compress(&st.cinfo, TRUE);
  const size_t stride = static_cast<size_t>(image.width * image.channels);
  while (st.cinfo.next_scanline < st.cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(image.pixels.data()) + stride * st.cinfo.next_scanline;
    jpeg_write_scanlines(&st.cinfo, &row, 1);
  }
  jpeg_finish_compress(&st.cinfo);
  jpeg_destroy_compress(&st.cinfo);
  return true;
}

// ---- PNG ----------------------------------------------------------------------------------

struct PngReader {
  const uint8_t* bytes;
  size_t size;
  size_t pos;
};

struct PngDecodeState {
  std::vector<uint8_t> raw;
  std::vector<png_bytep> rows;
  int64_t height = 0, width = 0, raw_channels = 0;
  bool too_large = false;
  char message[256] = {0};
};

void png_on_error(png_structp png, png_const_charp msg) {
  auto* message = static_cast<char*>(png_get_error_ptr(png));
  std::snprintf(message, 256, "%s", msg);
  png_longjmp(png, 1);
}
void png_on_warning(png_structp, png_const_charp) {}  // e.g. "known incorrect sRGB profile"

void png_read_mem(png_structp png, png_bytep out, png_size_t n) {
  auto* r = static_cast<PngReader*>(png_get_io_ptr(png));
  if (n > r->size - r->pos) png_error(png, "file truncated (read past the end of the data)");
  std::memcpy(out, r->bytes + r->pos, n);
  r->pos += n;
}

bool png_decode_raw(const uint8_t* bytes, size_t size, int64_t max_pixels, PngDecodeState& st) {
  PngReader reader{bytes, size, 0};
  png_structp png =
      png_create_read_struct(PNG_LIBPNG_VER_STRING, st.message, png_on_error, png_on_warning);
  if (!png) return false;
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  png_set_read_fn(png, &reader, png_read_mem);
  png_read_info(png, info);
  const png_uint_32 w = png_get_image_width(png, info);
  const png_uint_32 h = png_get_image_height(png, info);
  if (int64_t{w} * h > max_pixels) {
    st.too_large = true;
    st.width = w;
    st.height = h;
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  const int color = png_get_color_type(png, info);
  const int depth = png_get_bit_depth(png, info);
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (depth == 16) png_set_scale_16(png);
  // Alpha is dropped, including the one that palette expansion makes from a tRNS chunk.
  if ((color & PNG_COLOR_MASK_ALPHA) || png_get_valid(png, info, PNG_INFO_tRNS)) {
    png_set_strip_alpha(png);
  }
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  st.height = h;
  st.width = w;
  st.raw_channels = png_get_channels(png, info);
  const size_t stride = png_get_rowbytes(png, info);
  if (stride != static_cast<size_t>(st.width * st.raw_channels) ||
      (st.raw_channels != 1 && st.raw_channels != 3)) {
    std::snprintf(st.message, sizeof st.message, "unexpected PNG layout");
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  st.raw.resize(stride * h);
  st.rows.resize(h);
  for (png_uint_32 y = 0; y < h; ++y) st.rows[y] = st.raw.data() + stride * y;
  png_read_image(png, st.rows.data());
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

struct PngEncodeState {
  std::vector<uint8_t> out;
  std::vector<png_bytep> rows;
  char message[256] = {0};
};

void png_write_mem(png_structp png, png_bytep data, png_size_t n) {
  auto* out = static_cast<std::vector<uint8_t>*>(png_get_io_ptr(png));
  out->insert(out->end(), data, data + n);
}
void png_flush_mem(png_structp) {}

bool png_encode_raw(const Image& image, PngEncodeState& st) {
  png_structp png =
      png_create_write_struct(PNG_LIBPNG_VER_STRING, st.message, png_on_error, png_on_warning);
  if (!png) return false;
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return false;
  }
  static const int kColor[5] = {0, PNG_COLOR_TYPE_GRAY, PNG_COLOR_TYPE_GRAY_ALPHA,
                                PNG_COLOR_TYPE_RGB, PNG_COLOR_TYPE_RGB_ALPHA};
  png_set_write_fn(png, &st.out, png_write_mem, png_flush_mem);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width),
               static_cast<png_uint_32>(image.height), 8, kColor[image.channels],
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  const size_t stride = static_cast<size_t>(image.width * image.channels);
  st.rows.resize(static_cast<size_t>(image.height));
  for (size_t y = 0; y < st.rows.size(); ++y) {
    st.rows[y] = const_cast<uint8_t*>(image.pixels.data()) + stride * y;
  }
  png_set_rows(png, info, st.rows.data());
  png_write_png(png, info, PNG_TRANSFORM_IDENTITY, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

Image finish(const std::vector<uint8_t>& raw, int64_t h, int64_t w, int64_t raw_channels,
             bool adobe, int64_t channels) {
  Image img;
  img.height = h;
  img.width = w;
  img.channels = channels;
  img.pixels.resize(static_cast<size_t>(h * w * channels));
  if (raw_channels == channels) {
    std::memcpy(img.pixels.data(), raw.data(), img.pixels.size());
  } else {
    convert_channels(raw.data(), h * w, raw_channels, adobe, channels, img.pixels.data());
  }
  return img;
}

const char* kTooLarge = " pixels, more than the decoding limit (--max-image-pixels) of ";

}  // namespace

ImageFormat sniff_image_format(const uint8_t* bytes, size_t size) {
  static const uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (size >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF) {
    return ImageFormat::Jpeg;
  }
  if (size >= 8 && std::memcmp(bytes, kPng, 8) == 0) return ImageFormat::Png;
  return ImageFormat::Unknown;
}

Image decode_jpeg(const uint8_t* bytes, size_t size, int64_t channels, const std::string& what,
                  int64_t max_pixels) {
  check_channels(channels);
  auto st = std::make_unique<JpegDecodeState>();
  const bool ok = jpeg_decode_raw(bytes, size, max_pixels, *st);
  KILN_CHECK(!st->too_large, Data, "'", what, "': JPEG of ", st->width, "x", st->height, kTooLarge,
             max_pixels, "; treating the file as corrupt");
  KILN_CHECK(ok, Data, "'", what, "': corrupt JPEG (libjpeg: ", st->err.message, ")");
  KILN_CHECK(!st->err.truncated, Data, "'", what,
             "': truncated JPEG (the data ends before the image does)");
  return finish(st->raw, st->height, st->width, st->raw_channels, st->adobe, channels);
}

Image decode_png(const uint8_t* bytes, size_t size, int64_t channels, const std::string& what,
                 int64_t max_pixels) {
  check_channels(channels);
  PngDecodeState st;
  const bool ok = png_decode_raw(bytes, size, max_pixels, st);
  KILN_CHECK(!st.too_large, Data, "'", what, "': PNG of ", st.width, "x", st.height, kTooLarge,
             max_pixels, "; treating the file as corrupt");
  KILN_CHECK(ok, Data, "'", what, "': corrupt PNG (libpng: ", st.message, ")");
  return finish(st.raw, st.height, st.width, st.raw_channels, false, channels);
}

Image decode_image(const uint8_t* bytes, size_t size, int64_t channels, const std::string& what,
                   int64_t max_pixels) {
  switch (sniff_image_format(bytes, size)) {
    case ImageFormat::Jpeg:
      return decode_jpeg(bytes, size, channels, what, max_pixels);
    case ImageFormat::Png:
      return decode_png(bytes, size, channels, what, max_pixels);
    case ImageFormat::Unknown:
      break;
  }
  KILN_FAIL(Data, "'", what, "': neither JPEG nor PNG (", size,
            " bytes, unknown magic); the file is corrupt or has the wrong extension");
}

ImageInfo read_image_info(const uint8_t* bytes, size_t size, const std::string& what) {
  ImageInfo info;
  info.format = sniff_image_format(bytes, size);
  if (info.format == ImageFormat::Jpeg) {
    auto st = std::make_unique<JpegInfoState>();
    KILN_CHECK(jpeg_read_info(bytes, size, *st), Data, "'", what,
               "': corrupt JPEG header (libjpeg: ", st->err.message, ")");
    KILN_CHECK(!st->err.truncated, Data, "'", what,
               "': truncated JPEG (the data ends inside the header)");
    info.height = st->height;
    info.width = st->width;
    info.channels = st->components;
    info.progressive = st->progressive;
    info.cmyk = st->cmyk;
    info.complete = ends_with_eoi(bytes, size);
    return info;
  }
  if (info.format == ImageFormat::Png) {
    // The IHDR chunk comes first: length 13, "IHDR", width, height (big-endian), bit depth,
    // colour type.
    KILN_CHECK(size >= 8 + 8 + 13 && std::memcmp(bytes + 12, "IHDR", 4) == 0, Data, "'", what,
               "': corrupt PNG (no IHDR chunk after the signature)");
    auto be32 = [&](size_t at) {
      return (uint32_t{bytes[at]} << 24) | (uint32_t{bytes[at + 1]} << 16) |
             (uint32_t{bytes[at + 2]} << 8) | uint32_t{bytes[at + 3]};
    };
    info.width = be32(16);
    info.height = be32(20);
    const uint8_t color = bytes[25];
    KILN_CHECK(info.width > 0 && info.height > 0 && info.width <= 0x7fffffff &&
                   info.height <= 0x7fffffff && (color <= 6 && color != 1 && color != 5),
               Data, "'", what, "': corrupt PNG header (", info.width, "x", info.height,
               ", colour type ", int{color}, ")");
    static const int kChannels[7] = {1, 0, 3, 3, 2, 0, 4};  // grey, -, RGB, palette, GA, -, RGBA
    info.channels = kChannels[color];
    info.complete = size >= 12 && std::memcmp(bytes + size - 8, "IEND", 4) == 0;
    return info;
  }
  KILN_FAIL(Data, "'", what, "': neither JPEG nor PNG (", size,
            " bytes, unknown magic); the file is corrupt or has the wrong extension");
}

namespace {

// The geometry's output from a decoded image, converting channels as decode_image does; grey
// to 3 channels is resampled first and replicated after (the same values, a third of the work).
void resample_converted(const uint8_t* raw, int64_t h, int64_t w, int64_t raw_channels,
                        int64_t channels, const SampleGeometry& g, uint8_t* out,
                        ResampleOrder order, ResampleMath math) {
  if (raw_channels == channels) {
    resample_u8(raw, h, w, channels, w * channels, g, out, order, math);
    return;
  }
  if (raw_channels == 1 && channels == 3) {
    thread_local std::vector<uint8_t> grey;
    const int64_t n = g.out_h() * g.out_w();
    grey.resize(static_cast<size_t>(n));
    resample_u8(raw, h, w, 1, w, g, grey.data(), order, math);
    for (int64_t p = n - 1; p >= 0; --p) out[3 * p] = out[3 * p + 1] = out[3 * p + 2] = grey[p];
    return;
  }
  thread_local std::vector<uint8_t> conv;
  conv.resize(static_cast<size_t>(h * w * channels));
  convert_channels(raw, h * w, raw_channels, false, channels, conv.data());
  resample_u8(conv.data(), h, w, channels, w * channels, g, out, order, math);
}

void check_geometry(const SampleGeometry& g, int64_t h, int64_t w, const char* format,
                    const std::string& what) {
  KILN_CHECK(g.src_h == h && g.src_w == w, InvalidArgument, "'", what,
             "': the sample geometry refers "
             "to a ",
             g.src_h, "x", g.src_w, " image but the ", format, " is ", h, "x", w,
             "; draw it from the file's read_image_info");
}

}  // namespace

void decode_resampled(const uint8_t* bytes, size_t size, int64_t channels, const SampleGeometry& g,
                      uint8_t* out, const std::string& what, const ResampledDecodeOptions& o) {
  check_channels(channels);
  KILN_CHECK(g.src_h > 0 && g.src_w > 0 && g.out_h() > 0 && g.out_w() > 0, InvalidArgument, "'",
             what, "': decode_resampled needs a geometry with a source and output size, got ",
             g.src_h, "x", g.src_w, " -> ", g.out_h(), "x", g.out_w());
  // Checked here, not inside the libjpeg calls (where a throw would skip their cleanup).
  for (const ResampleAxis* a : {&g.y, &g.x}) {
    KILN_CHECK(
        a->scale > 0 && std::isfinite(a->scale) && std::isfinite(a->origin) && a->lo <= a->hi,
        InvalidArgument, "'", what, "': invalid sample geometry (scale ", a->scale, ", origin ",
        a->origin, ", lo ", a->lo, ", hi ", a->hi, ")");
  }
  const ImageFormat format = sniff_image_format(bytes, size);
  if (format == ImageFormat::Png) {
    const Image img = decode_png(bytes, size, channels, what, o.max_pixels);
    check_geometry(g, img.height, img.width, "PNG", what);
    resample_u8(img.pixels.data(), img.height, img.width, channels, img.width * channels, g, out,
                o.resample, o.math);
    return;
  }
  KILN_CHECK(format == ImageFormat::Jpeg, Data, "'", what, "': neither JPEG nor PNG (", size,
             " bytes, unknown magic); the file is corrupt or has the wrong extension");
  thread_local std::vector<uint8_t> raw;
  auto st = std::make_unique<JpegWindowState>();
  st->raw = &raw;
  WindowPlan plan{&g,           o.dct_scaling,      o.crop,       o.tight_margin,
                  o.batch_rows, o.progressive_stop, o.max_pixels, {}};
  const bool ok = jpeg_decode_window(bytes, size, plan, *st);
  KILN_CHECK(ok, Data, "'", what, "': corrupt JPEG (libjpeg: ", st->err.message, ")");
  KILN_CHECK(!st->too_large, Data, "'", what, "': JPEG of ", st->image_w, "x", st->image_h,
             kTooLarge, o.max_pixels, "; treating the file as corrupt");
  KILN_CHECK(!st->err.truncated, Data, "'", what,
             "': truncated JPEG (the data ends before the image does)");
  check_geometry(g, st->image_h, st->image_w, "JPEG", what);
  if (st->cmyk) {  // rare: the full decode converts CMYK, then the plain resample
    const Image img = decode_jpeg(bytes, size, channels, what, o.max_pixels);
    resample_u8(img.pixels.data(), img.height, img.width, channels, img.width * channels, g, out,
                o.resample, o.math);
    return;
  }
  const SampleGeometry local = shift_source(plan.scaled, st->top, st->left, st->rows, st->width);
  resample_converted(raw.data(), st->rows, st->width, st->raw_channels, channels, local, out,
                     o.resample, o.math);
  // The buffer is kept for the next sample, unless one huge image grew it (each loader thread
  // has one).
  if (raw.capacity() > (size_t{64} << 20)) std::vector<uint8_t>().swap(raw);
}

std::vector<uint8_t> encode_jpeg(const Image& image, int quality, const JpegEncodeOptions& o) {
  KILN_CHECK(image.channels == 1 || image.channels == 3 || image.channels == 4, InvalidArgument,
             "JPEG encoding takes 1, 3 or 4 (CMYK) channels, not ", image.channels);
  KILN_CHECK(quality >= 1 && quality <= 100, InvalidArgument, "JPEG quality ", quality,
             " is outside 1..100");
  KILN_CHECK(image.height > 0 && image.width > 0 &&
                 image.pixels.size() == static_cast<size_t>(image.numel()),
             InvalidArgument, "cannot encode an empty or inconsistent image");
  auto st = std::make_unique<JpegEncodeState>();
  KILN_CHECK(jpeg_encode_raw(image, quality, o, *st), Internal,
             "JPEG encoding failed (libjpeg: ", st->err.message, ")");
  return std::move(st->out);
}

std::vector<uint8_t> encode_png(const Image& image) {
  KILN_CHECK(image.channels >= 1 && image.channels <= 4, InvalidArgument,
             "PNG encoding takes 1 to 4 channels, not ", image.channels);
  KILN_CHECK(image.height > 0 && image.width > 0 &&
                 image.pixels.size() == static_cast<size_t>(image.numel()),
             InvalidArgument, "cannot encode an empty or inconsistent image");
  PngEncodeState st;
  KILN_CHECK(png_encode_raw(image, st), Internal, "PNG encoding failed (libpng: ", st.message, ")");
  return std::move(st.out);
}

}  // namespace kiln
