// The progressive JPEG decode's early stop (KILN_JPEG_PROGRESSIVE_STOP); see the header.
// Order matters: jpeglib.h needs FILE and size_t declared first.
// clang-format off
#include <stdio.h>
#include <jpeglib.h>
// clang-format on

#include "jpeg_progressive.h"

#include <cstring>

namespace kiln {

namespace {

// Moves the source to the next marker that is not a restart marker: the rest of a scan whose
// remaining rows are not needed is skipped with memchr instead of entropy-decoded (or walked
// byte by byte by libjpeg's next_marker, which also warns).
void skip_to_marker(jpeg_decompress_struct& cinfo) {
  const int pending = cinfo.unread_marker;
  if (pending != 0 && (pending < JPEG_RST0 || pending > JPEG_RST0 + 7)) return;
  cinfo.unread_marker = 0;
  const JOCTET* p = cinfo.src->next_input_byte;
  const JOCTET* end = p + cinfo.src->bytes_in_buffer;
  while (p + 1 < end) {
    p = static_cast<const JOCTET*>(std::memchr(p, 0xFF, static_cast<size_t>(end - 1 - p)));
    if (!p) return;  // none: libjpeg's own marker search finds the end of the data
    const JOCTET b = p[1];
    if (b != 0x00 && b != 0xFF && (b < JPEG_RST0 || b > JPEG_RST0 + 7)) {
      cinfo.src->bytes_in_buffer = static_cast<size_t>(end - p);
      cinfo.src->next_input_byte = p;
      return;
    }
    ++p;
  }
}

}  // namespace

void consume_progressive(jpeg_decompress_struct& cinfo, unsigned stop) {
  bool whole[MAX_COMPONENTS] = {};
  for (;;) {
    const int r = jpeg_consume_input(&cinfo);
    if (r == JPEG_REACHED_EOI || r == JPEG_SUSPENDED) return;
    if (r != JPEG_ROW_COMPLETED && r != JPEG_SCAN_COMPLETED) continue;
    bool written = true;
    for (int i = 0; i < cinfo.comps_in_scan; ++i) {
      const int c = cinfo.cur_comp_info[i]->component_index;
      if (r == JPEG_SCAN_COMPLETED && c >= 0 && c < MAX_COMPONENTS) whole[c] = true;
      written = written && c >= 0 && c < MAX_COMPONENTS && whole[c];
    }
    if (r == JPEG_ROW_COMPLETED && written && cinfo.input_iMCU_row == stop &&
        stop + 1 < cinfo.total_iMCU_rows) {
      cinfo.input_iMCU_row = cinfo.total_iMCU_rows - 1;
      if (jpeg_consume_input(&cinfo) == JPEG_SCAN_COMPLETED) skip_to_marker(cinfo);
    }
  }
}

}  // namespace kiln
