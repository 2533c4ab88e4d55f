// The int8 product itself, sums[rows, out] int32 = xq[rows, in] int8 times q[in, out] int8,
// exact, chosen by what the CPU multiplies in hardware.
//
// Where it sums int8 pairs into 32 bits (AVX512-VNNI, AVX-VNNI, AMX), oneDNN's kernels do it
// through at::_int_mm. On other AVX2 CPUs (a Zen 3), or where oneDNN is capped below VNNI,
// oneDNN's int8 kernels add pairs in 16 bits first, which saturate; here both sides are widened
// to int16 and `vpmaddwd` multiplies 16 pairs into 8 exact int32 sums an instruction. A Zen 3
// issues two a cycle, twice the multiply-adds of its two float32 FMA pipes: 1.6-1.7x PyTorch's
// float32 product at a prompt step's shapes, measured (benchmarks/RESULTS.md). The sums are
// exact either way, so both give the same bits.

#include "cpu_int8.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace engine_cpu {

namespace {

// Whether oneDNN's int8 kernels sum int8 pairs exactly here: a CPU with VNNI or AMX (this build's
// flags), unless ONEDNN_MAX_CPU_ISA caps oneDNN at a set without them (as tests/cpu_kinds.py's
// avx2 run does), where they would saturate.
bool onednn_sums_exactly() {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__) || defined(__AMX_INT8__)
  static const bool exact = [] {
    const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
    std::string isa = cap == nullptr ? "" : cap;
    for (char& c : isa) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return !(isa == "SSE41" || isa == "AVX" || isa == "AVX2" || isa == "AVX512_CORE");
  }();
  return exact;
#else
  return false;
#endif
}

#if defined(__AVX2__)

// Output features in a packed panel: two registers of eight int32 sums.
constexpr int64_t kPanel = 16;
// Rows a tile carries: 12 accumulators, the panel's two registers, a row's broadcast pair and
// its products fill AVX2's 16 registers.
constexpr int64_t kTileRows = 6;
// Rows a task widens once and multiplies by each of its panels (8 tiles, 48 x in int16 in L2).
constexpr int64_t kBlockRows = 8 * kTileRows;
// Panels a task multiplies in turn; with the row blocks they give 2-core machines enough tasks at
// a decode step's few rows.
constexpr int64_t kTaskPanels = 4;
// Blocks of rows a thread must have for a task to be a whole block (every panel): with tasks
// claimed one at a time, the last one leaves the others idle for at most a quarter of a thread's
// share.
constexpr int64_t kBlocksPerThread = 4;

// `width` (at most 16) int8 columns of one row of q, zero past them.
inline __m128i load_columns(const int8_t* row, int64_t width) {
  if (width == kPanel) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  alignas(16) int8_t columns[kPanel] = {};
  std::memcpy(columns, row, width);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(columns));
}

// Columns c0 .. c0 + 16 of q [in, out] as the tiles read them: for each pair of input rows
// (2p, 2p + 1), 16 int16 pairs (q[2p][c], q[2p + 1][c]), columns past `out` and a missing last
// row zero. `panel` (32-byte aligned) holds pairs * 32 int16.
void pack_panel(const int8_t* q, int64_t in, int64_t out, int64_t c0, int16_t* panel) {
  const int64_t width = std::min(kPanel, out - c0), pairs = (in + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m128i even = load_columns(q + 2 * p * out + c0, width);
    const __m128i odd = 2 * p + 1 < in ? load_columns(q + (2 * p + 1) * out + c0, width) : _mm_setzero_si128();
    __m256i* dst = reinterpret_cast<__m256i*>(panel + p * 2 * kPanel);
    _mm256_store_si256(dst, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(even, odd)));
    _mm256_store_si256(dst + 1, _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(even, odd)));
  }
}

// Rows of xq [rows, in] widened to int16, `stride` (even, >= in) apart, zero past `in`.
void widen_rows(const int8_t* xq, int64_t rows, int64_t in, int64_t stride, int16_t* wide) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* src = xq + r * in;
    int16_t* dst = wide + r * stride;
    int64_t k = 0;
    for (; k + 16 <= in; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
    for (; k < stride; ++k) dst[k] = k < in ? src[k] : 0;
  }
}

// One row's pair (two int16 in a word) times the panel's two registers, added to its sums.
inline void add_pair(__m256i& low, __m256i& high, int32_t pair, __m256i panel_low, __m256i panel_high) {
  const __m256i x = _mm256_set1_epi32(pair);
  low = _mm256_add_epi32(low, _mm256_madd_epi16(x, panel_low));
  high = _mm256_add_epi32(high, _mm256_madd_epi16(x, panel_high));
}

void store_sums(int32_t* dst, __m256i low, __m256i high, int64_t width) {
  if (width == kPanel) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), low);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), high);
    return;
  }
  alignas(32) int32_t sums[kPanel];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), low);
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), high);
  std::memcpy(dst, sums, width * sizeof(int32_t));
}

// Six widened rows (`wide`, `stride` int16 apart) times one packed panel into sums (`out` apart).
// Named accumulators, not arrays, and rows addressed from two pointers by one stride (x86's
// scaled indexes): GCC keeps the twelve sums and the addresses in registers, 30% faster on one
// Zen 3 core than six row pointers, which it reloaded from the stack at every pair.
void tile6(const int16_t* wide, int64_t stride, const int16_t* panel, int64_t pairs, int32_t* sums, int64_t out,
           int64_t width) {
  const int64_t s = stride / 2;
  const int32_t* a = reinterpret_cast<const int32_t*>(wide);
  const int32_t* b = a + 3 * s;
  __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;
  __m256i l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  for (int64_t p = 0; p < pairs; ++p, ++a, ++b) {
    const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + p * 2 * kPanel));
    const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + p * 2 * kPanel + 8 * 2));
    add_pair(l0, h0, a[0], b0, b1);
    add_pair(l1, h1, a[s], b0, b1);
    add_pair(l2, h2, a[2 * s], b0, b1);
    add_pair(l3, h3, b[0], b0, b1);
    add_pair(l4, h4, b[s], b0, b1);
    add_pair(l5, h5, b[2 * s], b0, b1);
  }
  store_sums(sums, l0, h0, width);
  store_sums(sums + out, l1, h1, width);
  store_sums(sums + 2 * out, l2, h2, width);
  store_sums(sums + 3 * out, l3, h3, width);
  store_sums(sums + 4 * out, l4, h4, width);
  store_sums(sums + 5 * out, l5, h5, width);
}

// The same for one row (a block's last few).
void tile1(const int16_t* wide, const int16_t* panel, int64_t pairs, int32_t* sums, int64_t width) {
  const int32_t* a = reinterpret_cast<const int32_t*>(wide);
  __m256i low = _mm256_setzero_si256(), high = low;
  for (int64_t p = 0; p < pairs; ++p) {
    add_pair(low, high, a[p], _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + p * 2 * kPanel)),
             _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + p * 2 * kPanel + 8 * 2)));
  }
  store_sums(sums, low, high, width);
}

// A task: rows r0 .. r1 (at most a block) times panels j0 .. j1, read from the call's packed
// panels (`packed`, pairs * 32 int16 apart) or, where it has none, each packed in turn into
// `panel`.
void product_task(const int8_t* xq, const int8_t* q, int64_t in, int64_t out, int64_t r0, int64_t r1, int64_t j0,
                  int64_t j1, int32_t* sums, const int16_t* packed, int16_t* wide, int16_t* panel) {
  const int64_t pairs = (in + 1) / 2, stride = 2 * pairs;
  widen_rows(xq + r0 * in, r1 - r0, in, stride, wide);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t c0 = j * kPanel, width = std::min(kPanel, out - c0);
    if (packed == nullptr) pack_panel(q, in, out, c0, panel);
    const int16_t* b = packed == nullptr ? panel : packed + j * pairs * 2 * kPanel;
    int64_t r = r0;
    for (; r + kTileRows <= r1; r += kTileRows)
      tile6(wide + (r - r0) * stride, stride, b, pairs, sums + r * out + c0, out, width);
    for (; r < r1; ++r) tile1(wide + (r - r0) * stride, b, pairs, sums + r * out + c0, width);
  }
}

// A thread's scratch, left unfilled (every element read is written first): its widened rows
// and, where the call packed no panels, one panel, 32-byte aligned for the tiles' loads.
struct TaskBuffers {
  TaskBuffers(int64_t pairs, bool needs_panel)
      : wide(new int16_t[kBlockRows * 2 * pairs]),
        panel_storage(needs_panel ? new int16_t[pairs * 2 * kPanel + 16] : nullptr) {}
  int16_t* panel() const {
    if (panel_storage == nullptr) return nullptr;
    const uintptr_t address = reinterpret_cast<uintptr_t>(panel_storage.get());
    return panel_storage.get() + (32 - address % 32) % 32 / sizeof(int16_t);
  }
  std::unique_ptr<int16_t[]> wide, panel_storage;
};

// Every panel packed once for the call (64-byte aligned by PyTorch's allocator), to be read by
// each block of rows.
at::Tensor pack_panels(const int8_t* q, int64_t in, int64_t out, const at::TensorOptions& options) {
  const int64_t panels = (out + kPanel - 1) / kPanel, pairs = (in + 1) / 2;
  at::Tensor packed = at::empty({panels * pairs * 2 * kPanel}, options.dtype(at::kShort));
  int16_t* pp = packed.data_ptr<int16_t>();
  at::parallel_for(0, panels, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) pack_panel(q, in, out, j * kPanel, pp + j * pairs * 2 * kPanel);
  });
  return packed;
}

void int16_pair_product(const at::Tensor& xq, const at::Tensor& q, at::Tensor& sums, const RowsDone& done) {
  const int64_t rows = xq.size(0), in = xq.size(1), out = q.size(1), pairs = (in + 1) / 2;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows, panels = (out + kPanel - 1) / kPanel;
  const int8_t *xp = xq.data_ptr<int8_t>(), *wp = q.data_ptr<int8_t>();
  int32_t* sp = sums.data_ptr<int32_t>();
  const int64_t threads = at::get_num_threads();
  // Enough blocks of rows (a prompt step) for every thread to take several whole: a task is a
  // block times every panel, widened once and handed to `done` while its sums sit in the
  // thread's cache. Fewer (a decode step): a task is a block times kTaskPanels panels, each
  // packed by the task that reads it, so the weight is read once, as int8, and `done` runs
  // over the rows after.
  const bool whole_blocks = blocks >= kBlocksPerThread * threads;
  const int64_t chunk = whole_blocks ? panels : kTaskPanels, chunks = (panels + chunk - 1) / chunk;
  const at::Tensor packed = blocks > 1 ? pack_panels(wp, in, out, xq.options()) : at::Tensor();
  const int16_t* pp = packed.defined() ? packed.data_ptr<int16_t>() : nullptr;
  // Tasks claimed one at a time, not split in halves up front: where one core runs slower (a
  // busy neighbour), the other takes more (a tenth of the samples were threads waiting at the
  // end of the loop with halves).
  const int64_t tasks = blocks * chunks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(tasks, threads), 1, [&](int64_t, int64_t) {
    const TaskBuffers buffers(pairs, pp == nullptr);
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t block = t / chunks, j0 = t % chunks * chunk;
      const int64_t r0 = block * kBlockRows, r1 = std::min(rows, r0 + kBlockRows);
      product_task(xp, wp, in, out, r0, r1, j0, std::min(panels, j0 + chunk), sp, pp, buffers.wide.get(),
                   buffers.panel());
      if (whole_blocks && done) done(r0, r1);
    }
  });
  if (!whole_blocks && done) at::parallel_for(0, rows, 16, done);
}
#endif

}  // namespace

void int8_product(const at::Tensor& xq, const at::Tensor& q, at::Tensor& sums, const RowsDone& done) {
  TORCH_CHECK(xq.scalar_type() == at::kChar && q.scalar_type() == at::kChar && xq.dim() == 2 && q.dim() == 2 &&
                  xq.size(1) == q.size(0) && xq.is_contiguous() && q.is_contiguous(),
              "int8_product: xq [rows, in] and q [in, out], contiguous int8");
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.is_contiguous() &&
                  sums.sizes() == at::IntArrayRef({xq.size(0), q.size(1)}),
              "int8_product: sums [rows, out], contiguous int32");
#if defined(__AVX2__)
  if (!onednn_sums_exactly()) return int16_pair_product(xq, q, sums, done);
#endif
  at::_int_mm_out(sums, xq, q);
  if (done) at::parallel_for(0, xq.size(0), 16, done);
}

at::Tensor int8_product(const at::Tensor& xq, const at::Tensor& q) {
  TORCH_CHECK(xq.dim() == 2 && q.dim() == 2, "int8_product: xq [rows, in] and q [in, out], int8");
  at::Tensor sums = at::empty({xq.size(0), q.size(1)}, xq.options().dtype(at::kInt));
  int8_product(xq.contiguous(), q.contiguous(), sums, {});
  return sums;
}

}  // namespace engine_cpu
