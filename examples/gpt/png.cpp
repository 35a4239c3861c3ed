#include "png.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "demo_support.h"

namespace distill::examples {

Image::Image(int w, int h, uint32_t fill) : width(w), height(h), rgb(static_cast<size_t>(w) * h * 3) {
  for (size_t i = 0; i < rgb.size(); i += 3) {
    rgb[i] = static_cast<uint8_t>(fill >> 16);
    rgb[i + 1] = static_cast<uint8_t>(fill >> 8);
    rgb[i + 2] = static_cast<uint8_t>(fill);
  }
}

void Image::set(int x, int y, uint32_t color) {
  if (x < 0 || y < 0 || x >= width || y >= height) return;
  uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
  p[0] = static_cast<uint8_t>(color >> 16);
  p[1] = static_cast<uint8_t>(color >> 8);
  p[2] = static_cast<uint8_t>(color);
}

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc) {
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t adler32(const uint8_t* data, size_t n, uint32_t adler) {
  uint32_t a = adler & 0xffff, b = adler >> 16;
  for (size_t i = 0; i < n; ++i) {
    a = (a + data[i]) % 65521;
    b = (b + a) % 65521;
  }
  return (b << 16) | a;
}

namespace {

void put32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
}

void chunk(std::string& out, const char* type, const std::string& data) {
  put32(out, static_cast<uint32_t>(data.size()));
  std::string body = std::string(type, 4) + data;
  out += body;
  put32(out, crc32(reinterpret_cast<const uint8_t*>(body.data()), body.size()));
}

}  // namespace

std::string encodePng(const Image& image) {
  // Scanlines, each led by filter type 0 (none).
  std::string raw;
  const size_t stride = static_cast<size_t>(image.width) * 3;
  raw.reserve((stride + 1) * image.height);
  for (int y = 0; y < image.height; ++y) {
    raw.push_back('\0');
    raw.append(reinterpret_cast<const char*>(&image.rgb[y * stride]), stride);
  }
  // zlib stream of stored (uncompressed) deflate blocks of at most 65535 bytes.
  std::string z = "\x78\x01";
  for (size_t off = 0; off < raw.size() || off == 0; off += 65535) {
    const size_t len = std::min<size_t>(65535, raw.size() - off);
    const bool last = off + len >= raw.size();
    z.push_back(last ? '\x01' : '\x00');
    z.push_back(static_cast<char>(len & 0xff));
    z.push_back(static_cast<char>(len >> 8));
    z.push_back(static_cast<char>(~len & 0xff));
    z.push_back(static_cast<char>((~len >> 8) & 0xff));
    z.append(raw, off, len);
    if (last) break;
  }
  put32(z, adler32(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()));

  std::string png = "\x89PNG\r\n\x1a\n";
  std::string ihdr;
  put32(ihdr, static_cast<uint32_t>(image.width));
  put32(ihdr, static_cast<uint32_t>(image.height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8 bits, RGB, deflate, adaptive filters, no interlace
  chunk(png, "IHDR", ihdr);
  chunk(png, "IDAT", z);
  chunk(png, "IEND", "");
  return png;
}

void writePng(const std::string& path, const Image& image) {
  const std::string data = encodePng(image);
  const std::string tmp = path + ".tmp";
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(tmp.c_str(), "wb"), &std::fclose);
  if (!f || std::fwrite(data.data(), 1, data.size(), f.get()) != data.size() || std::fflush(f.get()) != 0) {
    throw std::runtime_error("png " + tmp + ": cannot write: " + std::strerror(errno));
  }
  f.reset();
  publishFile(tmp, path);
}

// ---- chart ----

namespace {

// 5x7 glyphs; lower case is drawn as upper case.
const std::map<char, std::vector<const char*>>& font() {
  static const std::map<char, std::vector<const char*>> f = {
      {'0', {" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "}},
      {'1', {"  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
      {'2', {" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"}},
      {'3', {"#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "}},
      {'4', {"   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "}},
      {'5', {"#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "}},
      {'6', {"  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "}},
      {'7', {"#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "}},
      {'8', {" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "}},
      {'9', {" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "}},
      {'.', {"     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "}},
      {',', {"     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "}},
      {'-', {"     ", "     ", "     ", "#####", "     ", "     ", "     "}},
      {'+', {"     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "}},
      {'=', {"     ", "     ", "#####", "     ", "#####", "     ", "     "}},
      {':', {"     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "}},
      {'/', {"     ", "    #", "   # ", "  #  ", " #   ", "#    ", "     "}},
      {'(', {"   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "}},
      {')', {" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "}},
      {'%', {"##   ", "##  #", "   # ", "  #  ", " #   ", "#  ##", "   ##"}},
      {'_', {"     ", "     ", "     ", "     ", "     ", "     ", "#####"}},
      {'A', {" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"}},
      {'B', {"#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "}},
      {'C', {" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "}},
      {'D', {"###  ", "#  # ", "#   #", "#   #", "#   #", "#  # ", "###  "}},
      {'E', {"#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"}},
      {'F', {"#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "}},
      {'G', {" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"}},
      {'H', {"#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"}},
      {'I', {" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
      {'J', {"  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "}},
      {'K', {"#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"}},
      {'L', {"#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"}},
      {'M', {"#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"}},
      {'N', {"#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"}},
      {'O', {" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "}},
      {'P', {"#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "}},
      {'Q', {" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"}},
      {'R', {"#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"}},
      {'S', {" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "}},
      {'T', {"#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "}},
      {'U', {"#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "}},
      {'V', {"#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "}},
      {'W', {"#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "}},
      {'X', {"#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"}},
      {'Y', {"#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "}},
      {'Z', {"#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"}},
  };
  return f;
}

constexpr int kScale = 2;                       // font pixels per glyph pixel
constexpr int kGlyphW = 6 * kScale;             // advance, one column of spacing
constexpr int kGlyphH = 7 * kScale;

int textWidth(const std::string& s) { return static_cast<int>(s.size()) * kGlyphW; }

void drawText(Image& img, int x, int y, const std::string& s, uint32_t color, bool vertical = false) {
  for (size_t i = 0; i < s.size(); ++i) {
    auto it = font().find(static_cast<char>(std::toupper(static_cast<unsigned char>(s[i]))));
    if (it == font().end()) continue;  // space and anything unknown: blank
    for (int r = 0; r < 7; ++r) {
      for (int c = 0; c < 5; ++c) {
        if (it->second[r][c] != '#') continue;
        for (int dy = 0; dy < kScale; ++dy) {
          for (int dx = 0; dx < kScale; ++dx) {
            const int gx = static_cast<int>(i) * kGlyphW + c * kScale + dx, gy = r * kScale + dy;
            // Vertical text reads bottom to top.
            if (vertical) img.set(x + gy, y - gx, color);
            else img.set(x + gx, y + gy, color);
          }
        }
      }
    }
  }
}

// Pixels outside `clip` (x0, y0, x1, y1; default: the whole image) are not drawn.
struct Clip {
  int x0 = INT_MIN, y0 = INT_MIN, x1 = INT_MAX, y1 = INT_MAX;
  bool inside(int x, int y) const { return x >= x0 && x <= x1 && y >= y0 && y <= y1; }
};

void drawLine(Image& img, double x0, double y0, double x1, double y1, uint32_t color, int thick = 1,
              bool dashed = false, double* dashPhase = nullptr, const Clip& clip = {}) {
  const double len = std::hypot(x1 - x0, y1 - y0);
  const int n = std::max(1, static_cast<int>(std::ceil(len * 2)));
  double phase = dashPhase ? *dashPhase : 0;
  for (int i = 0; i <= n; ++i) {
    const double t = static_cast<double>(i) / n;
    const double along = phase + t * len;
    if (dashed && std::fmod(along, 14.0) >= 8.0) continue;
    const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0)));
    const int y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
    for (int dy = -(thick / 2); dy <= thick / 2; ++dy) {
      for (int dx = -(thick / 2); dx <= thick / 2; ++dx) {
        if (clip.inside(x + dx, y + dy)) img.set(x + dx, y + dy, color);
      }
    }
  }
  if (dashPhase) *dashPhase = phase + len;
}

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `target` ticks.
double niceStep(double span, int target) {
  const double raw = span / std::max(1, target);
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

std::string tickLabel(double v, double step) {
  char buf[32];
  const int decimals = step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace

Image renderChart(const std::vector<Series>& series, const ChartOptions& o) {
  Image img(o.width, o.height);
  const int left = 90, right = 20, top = 50, bottom = 70;
  const int pw = o.width - left - right, ph = o.height - top - bottom;

  double xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = -1e300;
  for (const Series& s : series) {
    for (auto [x, y] : s.points) {
      if (std::isfinite(x)) xmin = std::min(xmin, x), xmax = std::max(xmax, x);
    }
  }
  // The y range leaves out the first 5% of x: the loss at initialisation would
  // flatten everything after it. Those lines run off the top, clipped.
  for (const Series& s : series) {
    for (auto [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y) || x < xmin + 0.05 * (xmax - xmin)) continue;
      ymin = std::min(ymin, y), ymax = std::max(ymax, y);
    }
  }
  if (xmin > xmax) xmin = 0, xmax = 1;
  if (ymin > ymax) ymin = 0, ymax = 1;
  if (xmax - xmin < 1e-12) xmax = xmin + 1;
  if (ymax - ymin < 1e-12) ymax = ymin + 1;
  const double ypad = 0.05 * (ymax - ymin);
  ymin -= ypad, ymax += ypad;
  auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * pw; };
  auto py = [&](double y) { return top + (ymax - y) / (ymax - ymin) * ph; };

  // Grid and ticks.
  const uint32_t grid = 0xe6e6e6, axis = 0x333333;
  const double xs = niceStep(xmax - xmin, 8), ys = niceStep(ymax - ymin, 6);
  for (double x = std::ceil(xmin / xs) * xs; x <= xmax + 1e-9 * xs; x += xs) {
    drawLine(img, px(x), top, px(x), top + ph, grid);
    const std::string l = tickLabel(x, xs);
    drawText(img, static_cast<int>(px(x)) - textWidth(l) / 2, top + ph + 8, l, axis);
  }
  for (double y = std::ceil(ymin / ys) * ys; y <= ymax + 1e-9 * ys; y += ys) {
    drawLine(img, left, py(y), left + pw, py(y), grid);
    const std::string l = tickLabel(y, ys);
    drawText(img, left - 8 - textWidth(l), static_cast<int>(py(y)) - kGlyphH / 2, l, axis);
  }
  drawLine(img, left, top, left, top + ph, axis);
  drawLine(img, left, top + ph, left + pw, top + ph, axis);
  drawLine(img, left, top, left + pw, top, axis);
  drawLine(img, left + pw, top, left + pw, top + ph, axis);

  // Series, clipped to the plot.
  const Clip plot{left, top, left + pw, top + ph};
  for (const Series& s : series) {
    double phase = 0;
    for (size_t i = 1; i < s.points.size(); ++i) {
      drawLine(img, px(s.points[i - 1].first), py(s.points[i - 1].second), px(s.points[i].first),
               py(s.points[i].second), s.color, 3, s.dashed, &phase, plot);
    }
    if (s.points.size() == 1) {
      drawLine(img, px(s.points[0].first), py(s.points[0].second), px(s.points[0].first), py(s.points[0].second),
               s.color, 5, false, nullptr, plot);
    }
  }

  // Titles and legend (top right, inside the plot).
  drawText(img, (o.width - textWidth(o.title)) / 2, 16, o.title, 0x000000);
  drawText(img, left + (pw - textWidth(o.xLabel)) / 2, o.height - 28, o.xLabel, axis);
  drawText(img, 16, top + (ph + textWidth(o.yLabel)) / 2, o.yLabel, axis, /*vertical=*/true);
  int widest = 0;
  for (const Series& s : series) widest = std::max(widest, textWidth(s.label));
  const int lx = left + pw - widest - 70, ly = top + 12;
  for (int y = ly - 6; y < ly + static_cast<int>(series.size()) * (kGlyphH + 10); ++y) {
    for (int x = lx - 10; x < left + pw - 4; ++x) img.set(x, y, 0xffffff);
  }
  for (size_t i = 0; i < series.size(); ++i) {
    const int y = ly + static_cast<int>(i) * (kGlyphH + 10);
    drawLine(img, lx, y + kGlyphH / 2, lx + 40, y + kGlyphH / 2, series[i].color, 3, series[i].dashed);
    drawText(img, lx + 50, y, series[i].label, 0x000000);
  }
  return img;
}

}  // namespace distill::examples
