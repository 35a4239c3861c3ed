#pragma once

// A dependency-free PNG writer (8-bit RGB, stored deflate blocks, CRC32 and
// Adler-32) and a line-chart renderer for it, with a built-in 5x7 pixel font.
// zlib would compress better; a chart of flat colours is a few hundred KiB
// uncompressed, and the demo must not need a -dev package the build does not
// already install. No torch here.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace distill::examples {

struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  // width * height * 3, row-major, top row first

  Image(int w, int h, uint32_t fill = 0xffffff);
  void set(int x, int y, uint32_t color);  // 0xRRGGBB; outside the image: ignored
};

// The PNG file for `image`.
std::string encodePng(const Image& image);
// Writes it to `path` (temporary file + rename). Throws std::runtime_error naming the path.
void writePng(const std::string& path, const Image& image);

// CRC-32 (ISO 3309, as PNG uses) and Adler-32 (as zlib uses).
uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0);
uint32_t adler32(const uint8_t* data, size_t n, uint32_t adler = 1);

struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;  // (x, y), in x order
  uint32_t color = 0x1f77b4;
  bool dashed = false;
};

struct ChartOptions {
  int width = 900;
  int height = 560;
  std::string title;
  std::string xLabel;
  std::string yLabel;
};

// A line chart of `series` with axes, ticks, labels and a legend.
Image renderChart(const std::vector<Series>& series, const ChartOptions& options);

}  // namespace distill::examples
