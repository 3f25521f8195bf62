// The cropped decode of a progressive JPEG (image_codec.cpp, KILN_JPEG_PROGRESSIVE_STOP).
#pragma once

struct jpeg_decompress_struct;

namespace kiln {

// Buffered-image mode for a progressive file: a scan is entropy-decoded only down to iMCU row
// `stop` (the window's last row plus the rows the fancy upsampler and block smoothing read
// below it), then one more row (the coefficient controller's own step, landing in the image's
// last iMCU row, which the window never reads) ends the scan, and the source moves to the next
// scan's marker. The window's coefficients are those of a full decode. libjpeg's coefficient
// arrays must be written in order the first time (a writer that skips rows is an error), so a
// scan stops early only once every component in it has had a whole scan (in practice the
// first, DC scan).
// Call in buffered-image mode after jpeg_start_decompress; returns at EOI (or if the source
// suspends, which kiln's memory source never does), ready for jpeg_start_output.
void consume_progressive(jpeg_decompress_struct& cinfo, unsigned stop);

}  // namespace kiln
