#include "kernels/select.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "kernels/parallel.h"

namespace lightwire::kernels {

std::string formatNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

namespace {

constexpr size_t kSparseHeaderBytes = kHeaderBytes + 8;  // header, nnz u32, w u8, 3 reserved
constexpr uint8_t kFlagF16Values = 0x01;

constexpr size_t kScanBlock = 16;

/// Scans x[lo, hi) (raw data of dtype D) in blocks of kScanBlock: a block whose keys all lie
/// outside [key_lo, key_hi] is skipped with a branch-free (vectorisable) test; in the others,
/// visit(i, key) is called for every element in index order. Sparse selections thus cost about
/// one streaming read.
template <DType D, typename Visit>
inline void scanKeys(const void* data, size_t lo, size_t hi, uint32_t key_lo, uint32_t key_hi,
                     Visit&& visit) {
  const uint32_t span = key_hi - key_lo;  // key in range <=> key - key_lo <= span (u32)
  size_t i = lo;
  for (; i + kScanBlock <= hi; i += kScanBlock) {
    uint32_t hit = 0;
    for (size_t j = 0; j < kScanBlock; ++j) {
      hit |= static_cast<uint32_t>(magnitudeKey(loadWidened<D>(data, i + j)) - key_lo <= span);
    }
    if (hit == 0) continue;
    for (size_t j = 0; j < kScanBlock; ++j) visit(i + j, magnitudeKey(loadWidened<D>(data, i + j)));
  }
  for (; i < hi; ++i) visit(i, magnitudeKey(loadWidened<D>(data, i)));
}

/// Adds the histogram of key >> 20 over x[lo, hi) to h (SelectWorkspace::kBuckets counters).
/// Four interleaved u32 sub-histograms break the dependency between equal neighbouring keys.
template <DType D>
void histogramKeys(const void* data, size_t lo, size_t hi, uint64_t* h) {
  constexpr size_t kB = SelectWorkspace::kBuckets;
  constexpr size_t kPiece = size_t{1} << 30;  // keeps every u32 counter below 2^32
  uint32_t sub[4][kB];                        // 32 KiB of stack
  while (lo < hi) {
    const size_t end = hi - lo > kPiece ? lo + kPiece : hi;
    std::memset(sub, 0, sizeof sub);
    size_t i = lo;
    for (; i + 4 <= end; i += 4) {
      ++sub[0][magnitudeKey(loadWidened<D>(data, i)) >> 20];
      ++sub[1][magnitudeKey(loadWidened<D>(data, i + 1)) >> 20];
      ++sub[2][magnitudeKey(loadWidened<D>(data, i + 2)) >> 20];
      ++sub[3][magnitudeKey(loadWidened<D>(data, i + 3)) >> 20];
    }
    for (; i < end; ++i) ++sub[0][magnitudeKey(loadWidened<D>(data, i)) >> 20];
    for (size_t b = 0; b < kB; ++b) h[b] += uint64_t{sub[0][b]} + sub[1][b] + sub[2][b] + sub[3][b];
    lo = end;
  }
}

/// G: packed gap bytes rounded up to a multiple of 4. Safe for nnz < 2^32, w <= 32.
uint64_t gapBytes(uint64_t nnz, unsigned w) { return (packedBytes(nnz, w) + 3) & ~uint64_t{3}; }

/// Writes the sparse payload of the chunk x[begin, begin + len) whose selected elements are
/// idx[0, nnz) − base (chunk-local, ascending). Returns its size.
constexpr size_t kParallelGather = 8192;

size_t emitSparse(CodecId codec, DType source, DType values, const uint32_t* idx, size_t nnz,
                  size_t base, ConstTensor x, size_t begin, size_t len, CpuStream* stream,
                  std::span<uint8_t> out) {
  // Gaps: w is the bit length of the largest, which is that of the OR of all of them.
  uint32_t gap_or = 0;
  for (size_t j = 0, next = 0; j < nnz; ++j) {
    gap_or |= static_cast<uint32_t>(idx[j] - base - next);
    next = size_t{idx[j]} - base + 1;
  }
  const unsigned w = static_cast<unsigned>(std::bit_width(gap_or));
  const uint64_t packed = packedBytes(nnz, w);
  const uint64_t g = gapBytes(nnz, w);

  uint8_t* p = out.data();
  writeHeader(p, {codec, source, values == DType::kF16 ? kFlagF16Values : uint8_t{0}, 0, len});
  storeU32(p + 16, static_cast<uint32_t>(nnz));
  p[20] = static_cast<uint8_t>(w);
  p[21] = p[22] = p[23] = 0;
  uint8_t* gaps = p + kSparseHeaderBytes;
  if (w > 0) {
    BitWriter writer(gaps);
    for (size_t j = 0, next = 0; j < nnz; ++j) {
      writer.put(static_cast<uint32_t>(idx[j] - base - next), w);
      next = size_t{idx[j]} - base + 1;
    }
    writer.flush();
  }
  std::memset(gaps + packed, 0, g - packed);

  // Values: a gather, so split over the stream's threads when there are many (cache misses).
  uint8_t* vals = gaps + g;
  const size_t offset = begin - base;  // element of entry j: offset + idx[j] (mod 2^64)
  visitDType(x.dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    auto gather = [&](size_t lo, size_t hi) {
      if (values == DType::kF16) {
        for (size_t j = lo; j < hi; ++j) {
          storeU16(vals + 2 * j, floatToHalfSaturating(loadWidened<D>(x.data, offset + idx[j])));
        }
      } else {
        for (size_t j = lo; j < hi; ++j) {
          storeF32(vals + 4 * j, loadWidened<D>(x.data, offset + idx[j]));
        }
      }
    };
    if (stream != nullptr && nnz >= kParallelGather) {
      stream->parallelFor(nnz, kParallelGather / 2, gather);
    } else {
      gather(0, nnz);
    }
  });
  return kSparseHeaderBytes + g + dtypeSize(values) * nnz;
}

}  // namespace

size_t selectionSize(size_t n, double density) {
  if (n == 0) return 0;
  const double r = std::floor(density * static_cast<double>(n) + 0.5);
  if (!(r >= 1.0)) return 1;  // also NaN
  if (r >= static_cast<double>(n)) return n;
  return std::min(n, static_cast<size_t>(r));
}

Status checkDensity(double density, std::string_view what) {
  if (!(density > 0.0 && density <= 1.0)) {
    return invalidArgument(std::string(what) + " must be in (0, 1], got " + formatNumber(density));
  }
  return Status::ok();
}

Result<double> configuredDensity(const CodecConfig& config, std::string_view codec,
                                 std::optional<double> fallback) {
  const std::string name(codec);
  if (config.density && config.ratio) {
    return invalidArgument(name + ": set either density or ratio, not both (density " +
                           formatNumber(*config.density) + ", ratio " +
                           formatNumber(*config.ratio) + ")");
  }
  if (!config.density && !config.ratio) {
    if (fallback) return *fallback;
    return invalidArgument(name + ": needs density (in (0, 1]) or ratio (>= 1)");
  }
  if (config.density) {
    LW_RETURN_IF_ERROR(checkDensity(*config.density, name + ": density"));
    return *config.density;
  }
  const double ratio = *config.ratio;
  if (!(ratio >= 1.0) || !std::isfinite(ratio)) {
    return invalidArgument(name + ": ratio must be a finite number >= 1, got " +
                           formatNumber(ratio));
  }
  return 1.0 / ratio;
}

Status checkSparseValues(const CodecConfig& config, std::string_view codec) {
  if (config.sparse_values != DType::kF32 && config.sparse_values != DType::kF16) {
    return invalidArgument(std::string(codec) + ": sparse_values must be fp32 or fp16, got " +
                           std::string(dtypeName(config.sparse_values)));
  }
  return Status::ok();
}

TaskSplit TaskSplit::of(size_t n) {
  TaskSplit s;
  s.elements = n;
  s.tasks = std::clamp<size_t>((n + kMinTaskElements - 1) / kMinTaskElements, 1, kMaxTasks);
  return s;
}

void runTasks(CpuStream* stream, const TaskSplit& split, const std::function<void(size_t)>& fn) {
  if (stream == nullptr || stream->threads() <= 1 || split.tasks <= 1) {
    for (size_t t = 0; t < split.tasks; ++t) fn(t);
    return;
  }
  stream->parallelFor(split.tasks, 1, [&](size_t lo, size_t hi) {
    for (size_t t = lo; t < hi; ++t) fn(t);
  });
}

size_t SelectWorkspace::sampleCount(size_t n) { return n >= kGuideMinElements ? kGuideSamples : 0; }

size_t SelectWorkspace::bytes(size_t n) {
  return WorkspaceCarver::bytesFor({sizeof(SelectionPlan),
                                    TaskSplit::of(n).tasks * kBuckets * sizeof(uint64_t),
                                    sampleCount(n) * sizeof(uint32_t), n * sizeof(uint32_t)});
}

SelectWorkspace SelectWorkspace::carve(WorkspaceCarver& carver, size_t n) {
  SelectWorkspace ws;
  ws.plan = carver.take<SelectionPlan>(1).data();
  ws.histograms = carver.take<uint64_t>(TaskSplit::of(n).tasks * kBuckets);
  ws.samples = carver.take<uint32_t>(sampleCount(n));
  ws.slots = carver.take<uint32_t>(n);
  return ws;
}

namespace {

/// The k-th largest key is among cand[0..count), and `above` keys are larger than every
/// candidate: finds it (T) and where the ties with T are cut.
void finishSelection(ConstTensor x, size_t k, uint64_t above, uint32_t* cand, uint64_t count,
                     CpuStream* stream, SelectionPlan* plan) {
  const size_t n = x.elements;
  const uint64_t kk = k - above;  // 1 <= kk <= count
  std::nth_element(cand, cand + (kk - 1), cand + count, std::greater<uint32_t>());
  const uint32_t threshold = cand[kk - 1];
  uint64_t greater = 0, equal = 0;
  for (uint64_t j = 0; j < count; ++j) {
    greater += cand[j] > threshold;
    equal += cand[j] == threshold;
  }
  const uint64_t need = kk - greater;  // ties to take, 1 <= need <= equal
  plan->threshold = threshold;
  plan->select_none = false;
  if (need == equal) {
    plan->tie_end = n;
    return;
  }

  // Ties are cut: the need-th element (in index order) with key == threshold is the last taken.
  const TaskSplit split = TaskSplit::of(n);
  std::array<uint64_t, TaskSplit::kMaxTasks> ties{};
  visitDType(x.dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    runTasks(stream, split, [&](size_t t) {
      uint64_t c = 0;
      const size_t hi = split.end(t);
      for (size_t i = split.begin(t); i < hi; ++i) {
        c += magnitudeKey(loadWidened<D>(x.data, i)) == threshold;
      }
      ties[t] = c;
    });
  });
  uint64_t before = 0;
  size_t task = 0;
  while (before + ties[task] < need) before += ties[task++];
  uint64_t left = need - before;
  const size_t hi = split.end(task);
  for (size_t i = split.begin(task); i < hi; ++i) {
    if (magnitudeKey(x.at(i)) == threshold && --left == 0) {
      plan->tie_end = i + 1;
      return;
    }
  }
  plan->tie_end = n;  // unreachable: the counts above guarantee the element exists
}

/// Counts keys above b and copies keys in [a, b] to dst, over raw x[lo, hi). Keys are < 2^31,
/// so signed compares are exact (and vectorise on baseline x86-64).
template <DType D>
void collectBetween(const void* data, size_t lo, size_t hi, uint32_t a, uint32_t b, uint32_t* dst,
                    uint64_t* above, uint64_t* count) {
  const int32_t sa = static_cast<int32_t>(a), sb = static_cast<int32_t>(b);
  uint64_t up = 0, c = 0;
  size_t i = lo;
  for (; i + kScanBlock <= hi; i += kScanBlock) {
    int32_t keys[kScanBlock];
    for (size_t j = 0; j < kScanBlock; ++j) {
      keys[j] = static_cast<int32_t>(magnitudeKey(loadWidened<D>(data, i + j)));
    }
    uint32_t gt = 0, hit = 0;
    for (size_t j = 0; j < kScanBlock; ++j) {
      gt += static_cast<uint32_t>(keys[j] > sb);
      hit |= static_cast<uint32_t>((keys[j] >= sa) & (keys[j] <= sb));
    }
    up += gt;
    if (hit == 0) continue;
    for (size_t j = 0; j < kScanBlock; ++j) {
      if (keys[j] >= sa && keys[j] <= sb) dst[c++] = static_cast<uint32_t>(keys[j]);
    }
  }
  for (; i < hi; ++i) {
    const int32_t key = static_cast<int32_t>(magnitudeKey(loadWidened<D>(data, i)));
    up += key > sb;
    if (key >= sa && key <= sb) dst[c++] = static_cast<uint32_t>(key);
  }
  *above = up;
  *count = c;
}

/// Key bounds [a, b] that, judged by a strided sample of x, very likely hold the k-th largest key
/// (about four standard deviations of margin on each side). The sample only decides the speed,
/// never the result.
std::pair<uint32_t, uint32_t> guideBounds(ConstTensor x, size_t k, CpuStream* stream,
                                          const SelectWorkspace& ws) {
  const size_t n = x.elements;
  const size_t m = ws.samples.size();
  uint32_t* s = ws.samples.data();
  auto sample = [&](size_t lo, size_t hi) {
    for (size_t j = lo; j < hi; ++j) {
      s[j] = magnitudeKey(x.at(static_cast<size_t>((static_cast<unsigned __int128>(j) * n) / m)));
    }
  };
  if (stream != nullptr) {
    stream->parallelFor(m, 2048, sample);
  } else {
    sample(0, m);
  }
  // Rank (0-based, descending) the k-th largest key would have in the sample, with a margin.
  const double q = static_cast<double>(k) * static_cast<double>(m) / static_cast<double>(n);
  const double margin = 4.0 * std::sqrt(q) + 8.0;
  uint32_t b = 0x7FFFFFFFu, a = 0;
  if (q - margin >= 0.0) {
    const size_t r = static_cast<size_t>(q - margin);
    std::nth_element(s, s + r, s + m, std::greater<uint32_t>());
    b = s[r];
  }
  if (q + margin < static_cast<double>(m)) {
    const size_t r = static_cast<size_t>(q + margin);
    std::nth_element(s, s + r, s + m, std::greater<uint32_t>());
    a = s[r];
  }
  return {a, b};
}

/// compositeKey of every i in [lo, hi) of raw x (dtype D) with key >= a: the scalar reference of
/// collectCompositesF32, used for fp16/bf16 input.
template <DType D>
uint64_t collectCompositesScalar(const void* data, size_t lo, size_t hi, uint32_t a, uint64_t* dst,
                                 uint64_t cap) {
  uint64_t c = 0;
  for (size_t i = lo; i < hi; ++i) {
    const uint32_t key = magnitudeKey(loadWidened<D>(data, i));
    if (key >= a) {
      if (c < cap) dst[c] = compositeKey(key, i);
      ++c;
    }
  }
  return c;
}

/// One pass, and the selection listed: every element with key >= a is collected as its
/// compositeKey (which orders exactly as §4.3 does); the k-th largest composite among them is
/// the last selected element, so it gives T and the tie cut at once, and the collected elements
/// at or above it, in index order, are the list. Returns false (plan untouched) when a is 0, when
/// fewer than k keys are >= a (the sample missed) or when too many are (no room).
bool selectGuidedList(ConstTensor x, size_t k, uint32_t a, CpuStream* stream,
                      const SelectWorkspace& ws, SelectionPlan* plan) {
  const size_t n = x.elements;
  if (a == 0 || n > size_t{0xFFFFFFFFu}) return false;
  const TaskSplit split = TaskSplit::of(n);
  // Task t owns the u64 cells [begin(t) / 2, end(t) / 2) of the slots.
  uint64_t* comp = reinterpret_cast<uint64_t*>(ws.slots.data());
  std::array<uint64_t, TaskSplit::kMaxTasks> counts{};
  std::array<bool, TaskSplit::kMaxTasks> overflow{};
  visitDType(x.dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    runTasks(stream, split, [&](size_t t) {
      const size_t lo = split.begin(t), hi = split.end(t);
      uint64_t* dst = comp + lo / 2;
      const uint64_t cap = hi / 2 - lo / 2;
      uint64_t c;
      if constexpr (D == DType::kF32) {
        c = collectCompositesF32(static_cast<const float*>(x.data), lo, hi, a, dst, cap);
      } else {
        c = collectCompositesScalar<D>(x.data, lo, hi, a, dst, cap);
      }
      counts[t] = c;
      overflow[t] = c > cap;
    });
  });
  uint64_t total = 0;
  for (size_t t = 0; t < split.tasks; ++t) {
    if (overflow[t]) return false;
    const size_t from = split.begin(t) / 2;
    if (total != from && counts[t] > 0) {
      std::memmove(comp + total, comp + from, counts[t] * sizeof(uint64_t));
    }
    total += counts[t];
  }
  // The copy for nth_element needs `total` more cells: 2 · total u64 <= n u32.
  if (total < k || 4 * total > n) return false;
  uint64_t* copy = comp + total;
  std::memcpy(copy, comp, total * sizeof(uint64_t));
  std::nth_element(copy, copy + (k - 1), copy + total, std::greater<uint64_t>());
  const uint64_t last = copy[k - 1];
  // In place: u32 entry j' <= j is written after u64 cell j is read, never over an unread cell.
  uint32_t* list = ws.slots.data();
  uint64_t listed = 0;
  for (uint64_t j = 0; j < total; ++j) {
    const uint64_t c = comp[j];
    if (c >= last) list[listed++] = 0xFFFFFFFFu - static_cast<uint32_t>(c);
  }
  plan->threshold = static_cast<uint32_t>(last >> 32);
  plan->tie_end = uint64_t{0xFFFFFFFFu - static_cast<uint32_t>(last)} + 1;
  plan->select_none = false;
  plan->has_list = true;
  plan->listed = listed;  // == k
  return true;
}

/// One pass when [a, b] brackets the k-th largest key: the pass counts the keys above b and
/// collects those in [a, b]. Returns false (plan untouched) when the k-th largest key lies outside
/// [a, b].
bool selectGuided(ConstTensor x, size_t k, uint32_t a, uint32_t b, CpuStream* stream,
                  const SelectWorkspace& ws, SelectionPlan* plan) {
  const size_t n = x.elements;
  const TaskSplit split = TaskSplit::of(n);
  std::array<uint64_t, TaskSplit::kMaxTasks> above{}, counts{};
  uint32_t* cand = ws.slots.data();
  visitDType(x.dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    runTasks(stream, split, [&](size_t t) {
      collectBetween<D>(x.data, split.begin(t), split.end(t), a, b, cand + split.begin(t),
                        &above[t], &counts[t]);
    });
  });
  uint64_t total_above = 0, total = 0;
  for (size_t t = 0; t < split.tasks; ++t) {
    total_above += above[t];
    if (total != split.begin(t) && counts[t] > 0) {
      std::memmove(cand + total, cand + split.begin(t), counts[t] * sizeof(uint32_t));
    }
    total += counts[t];
  }
  if (!(total_above < k && k <= total_above + total)) return false;
  finishSelection(x, k, total_above, cand, total, stream, plan);
  return true;
}

/// Two passes whatever the data: a histogram of the top 11 key bits finds the bucket holding the
/// k-th largest key, then that bucket's keys are collected.
void selectByHistogram(ConstTensor x, size_t k, CpuStream* stream, const SelectWorkspace& ws,
                       SelectionPlan* plan) {
  constexpr size_t kB = SelectWorkspace::kBuckets;
  const TaskSplit split = TaskSplit::of(x.elements);
  uint64_t* hist = ws.histograms.data();
  visitDType(x.dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    runTasks(stream, split, [&](size_t t) {
      uint64_t* h = hist + t * kB;
      std::fill(h, h + kB, uint64_t{0});
      histogramKeys<D>(x.data, split.begin(t), split.end(t), h);
    });
  });

  uint64_t above = 0, in_bucket = 0;
  size_t bucket = 0;
  for (size_t b = kB; b-- > 0;) {
    uint64_t count = 0;
    for (size_t t = 0; t < split.tasks; ++t) count += hist[t * kB + b];
    if (above + count >= k) {
      bucket = b;
      in_bucket = count;
      break;
    }
    above += count;
  }

  // Each task writes the bucket's keys at its own exact offset.
  std::array<uint64_t, TaskSplit::kMaxTasks> offset{};
  for (size_t t = 0, o = 0; t < split.tasks; ++t) {
    offset[t] = o;
    o += hist[t * kB + bucket];
  }
  uint32_t* cand = ws.slots.data();
  visitDType(x.dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    runTasks(stream, split, [&](size_t t) {
      uint32_t* dst = cand + offset[t];
      const uint32_t key_lo = static_cast<uint32_t>(bucket) << 20;
      scanKeys<D>(x.data, split.begin(t), split.end(t), key_lo, key_lo | 0xFFFFFu,
                  [&](size_t, uint32_t key) {
                    if ((key >> 20) == bucket) *dst++ = key;
                  });
    });
  });
  finishSelection(x, k, above, cand, in_bucket, stream, plan);
}

}  // namespace

void selectExact(ConstTensor x, size_t k, CpuStream* stream, const SelectWorkspace& ws,
                 SelectionPlan* plan) {
  const size_t n = x.elements;
  *plan = SelectionPlan{};
  if (n == 0 || k == 0) return;
  if (k >= n) {  // everything: key > 0, or key == 0 anywhere
    *plan = SelectionPlan{0, n, false};
    return;
  }
  if (!ws.samples.empty()) {
    const auto [a, b] = guideBounds(x, k, stream, ws);
    if (selectGuidedList(x, k, a, stream, ws, plan)) return;
    if (selectGuided(x, k, a, b, stream, ws, plan)) return;
  }
  selectByHistogram(x, k, stream, ws, plan);
}

uint32_t minMagnitudeKey(double min_magnitude) {
  if (!(min_magnitude > 0.0)) return 0;
  float f = static_cast<float>(min_magnitude);  // nearest (+Inf beyond the fp32 range)
  if (static_cast<double>(f) < min_magnitude) {
    f = std::nextafter(f, std::numeric_limits<float>::infinity());
  }
  return magnitudeKey(f);
}

void applyMinKey(ConstTensor x, uint32_t min_key, std::span<uint32_t> slots, SelectionPlan* plan) {
  if (min_key == 0 || plan->select_none || plan->threshold >= min_key) return;
  plan->threshold = min_key;
  plan->tie_end = std::numeric_limits<uint64_t>::max();
  if (!plan->has_list) return;
  uint64_t kept = 0;
  for (uint64_t j = 0; j < plan->listed; ++j) {
    const uint32_t i = slots[j];
    slots[kept] = i;
    kept += magnitudeKey(x.at(i)) >= min_key;
  }
  plan->listed = kept;
}

uint64_t countKeysAtLeast(const float* x, size_t n, uint32_t threshold, CpuStream* stream) {
  const TaskSplit split = TaskSplit::of(n);
  std::array<uint64_t, TaskSplit::kMaxTasks> counts{};
  runTasks(stream, split, [&](size_t t) {
    uint64_t c = 0;
    const size_t hi = split.end(t);
    for (size_t i = split.begin(t); i < hi; ++i) c += magnitudeKey(x[i]) >= threshold;
    counts[t] = c;
  });
  uint64_t total = 0;
  for (size_t t = 0; t < split.tasks; ++t) total += counts[t];
  return total;
}

size_t sparseMaxPayloadBytes(size_t n, DType values) {
  // Every gap is <= n - 1, so w <= bit_width(n - 1); the size grows with nnz and w.
  const unsigned w = n == 0 ? 0 : static_cast<unsigned>(std::bit_width(uint64_t{n} - 1));
  return kSparseHeaderBytes + gapBytes(n, w) + dtypeSize(values) * n;
}

Result<SparseWritten> writeSparsePayload(CodecId codec, DType source, DType values,
                                         const SelectionPlan& plan, ConstTensor x, size_t begin,
                                         size_t len, std::span<uint32_t> indices, CpuStream* stream,
                                         std::span<uint8_t> out) {
  if (values != DType::kF32 && values != DType::kF16) {
    return invalidArgument("sparse values must be fp32 or fp16");
  }
  if (len > std::numeric_limits<uint32_t>::max()) {
    return outOfRange("chunk of " + std::to_string(len) +
                      " elements exceeds the sparse layout's u32 index range");
  }
  if (begin > x.elements || len > x.elements - begin) {
    return outOfRange("chunk [" + std::to_string(begin) + ", +" + std::to_string(len) +
                      ") lies outside the tensor of " + std::to_string(x.elements) + " elements");
  }
  if (indices.size() < len) return internalError("sparse index scratch too small");
  const size_t max_bytes = sparseMaxPayloadBytes(len, values);
  if (out.size() < max_bytes) {
    return outOfRange("payload buffer of " + std::to_string(out.size()) + " bytes, needs " +
                      std::to_string(max_bytes));
  }

  // Selected chunk-local indices, each task into its own slots, then compacted in task order.
  size_t nnz = 0;
  if (!plan.select_none && len > 0) {
    const TaskSplit split = TaskSplit::of(len);
    std::array<size_t, TaskSplit::kMaxTasks> counts{};
    const uint32_t threshold = plan.threshold;
    const uint64_t tie_end = plan.tie_end;
    visitDType(x.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      runTasks(stream, split, [&](size_t t) {
        const size_t lo = split.begin(t), hi = split.end(t);
        uint32_t* dst = indices.data() + lo;
        size_t c = 0;
        // Scanned in whole-tensor coordinates; slots and indices are chunk-local.
        scanKeys<D>(x.data, begin + lo, begin + hi, threshold, 0x7FFFFFFFu,
                    [&](size_t i, uint32_t key) {
                      const bool take = (key > threshold) | ((key == threshold) & (i < tie_end));
                      dst[c] = static_cast<uint32_t>(i - begin);  // c <= i - lo: own slots
                      c += take;
                    });
        counts[t] = c;
      });
    });
    for (size_t t = 0; t < split.tasks; ++t) {
      if (nnz != split.begin(t) && counts[t] > 0) {
        std::memmove(indices.data() + nnz, indices.data() + split.begin(t),
                     counts[t] * sizeof(uint32_t));
      }
      nnz += counts[t];
    }
  }

  const size_t bytes =
      emitSparse(codec, source, values, indices.data(), nnz, 0, x, begin, len, stream, out);
  return SparseWritten{bytes, nnz, 0};
}

Result<SparseWritten> writeSparsePayloadFromList(CodecId codec, DType source, DType values,
                                                 std::span<const uint32_t> list, ConstTensor x,
                                                 size_t begin, size_t len, CpuStream* stream,
                                                 std::span<uint8_t> out) {
  if (values != DType::kF32 && values != DType::kF16) {
    return invalidArgument("sparse values must be fp32 or fp16");
  }
  if (begin > x.elements || len > x.elements - begin) {
    return outOfRange("chunk [" + std::to_string(begin) + ", +" + std::to_string(len) +
                      ") lies outside the tensor of " + std::to_string(x.elements) + " elements");
  }
  if (x.elements > size_t{0xFFFFFFFFu}) {
    return internalError("listed selection of a tensor of 2^32 or more elements");
  }
  const size_t max_bytes = sparseMaxPayloadBytes(len, values);
  if (out.size() < max_bytes) {
    return outOfRange("payload buffer of " + std::to_string(out.size()) + " bytes, needs " +
                      std::to_string(max_bytes));
  }
  const auto lo = std::lower_bound(list.begin(), list.end(), static_cast<uint32_t>(begin));
  const auto hi = begin + len >= size_t{0xFFFFFFFFu}
                      ? list.end()
                      : std::lower_bound(lo, list.end(), static_cast<uint32_t>(begin + len));
  const size_t first = static_cast<size_t>(lo - list.begin());
  const size_t nnz = static_cast<size_t>(hi - lo);
  const size_t bytes = emitSparse(codec, source, values, list.data() + first, nnz, begin, x, begin,
                                  len, stream, out);
  return SparseWritten{bytes, nnz, first};
}

Result<SparseLayout> parseSparsePayload(std::span<const uint8_t> payload, CodecId codec,
                                        size_t out_elements) {
  auto header = readHeader(payload, codec, out_elements, kFlagF16Values);
  if (!header) return header.status();
  SparseLayout layout;
  layout.header = *header;
  if (header->codec == CodecId::kNone) {
    const uint64_t need = kHeaderBytes + 4 * header->elements;
    if (header->elements > (payload.size() / 4) || payload.size() != need) {
      return dataLoss("none payload of " + std::to_string(header->elements) + " elements must be " +
                      std::to_string(need) + " bytes, got " + std::to_string(payload.size()));
    }
    layout.dense = true;
    return layout;
  }
  const std::string name = codecIdName(codec);
  if (payload.size() < kSparseHeaderBytes) {
    return dataLoss(name + " payload truncated: " + std::to_string(payload.size()) +
                    " bytes, the sparse header needs " + std::to_string(kSparseHeaderBytes));
  }
  const uint8_t* p = payload.data();
  const uint64_t n = header->elements;
  const uint64_t nnz = loadU32(p + 16);
  const unsigned w = p[20];
  if (p[21] != 0 || p[22] != 0 || p[23] != 0) {
    return dataLoss(name + " payload has non-zero reserved bytes after w");
  }
  if (nnz > n) {
    return dataLoss(name + " payload claims nnz " + std::to_string(nnz) + " > " +
                    std::to_string(n) + " elements");
  }
  if (w > 32) return dataLoss(name + " payload gap width " + std::to_string(w) + " exceeds 32");
  // nnz < 2^32 and w <= 32: every term below is < 2^40, no overflow.
  const uint64_t g = gapBytes(nnz, w);
  const uint64_t value_bytes = (header->flags & kFlagF16Values) ? 2 : 4;
  const uint64_t need = kSparseHeaderBytes + g + value_bytes * nnz;
  if (payload.size() != need) {
    return dataLoss(name + " payload with nnz " + std::to_string(nnz) + " and w " +
                    std::to_string(w) + " must be " + std::to_string(need) + " bytes, got " +
                    std::to_string(payload.size()));
  }
  const uint8_t* gaps = p + kSparseHeaderBytes;
  if (!paddingIsZero({gaps, static_cast<size_t>(g)}, nnz * w)) {
    return dataLoss(name + " payload has non-zero padding bits after its gaps");
  }
  layout.nnz = nnz;
  layout.w = w;
  layout.value_bytes = value_bytes;
  layout.gaps = gaps;
  layout.values = gaps + g;
  return layout;
}

namespace {

/// Calls fn(j, i) for entry j of a parsed sparse layout (not the `none` escape), index i, in
/// order, until fn returns false. Indices are not checked against the chunk.
/// Gap j sits at stream bits [j·w, j·w + w). With nnz >= 8 the value bytes that follow the gaps
/// (>= 16) keep an 8-byte load at any gap's first byte inside the payload, so gaps are read with
/// one unaligned load each; shorter payloads use the byte-wise BitReader.
template <typename Fn>
void forEachGapIndex(const SparseLayout& layout, Fn&& fn) {
  const uint64_t nnz = layout.nnz;
  const unsigned w = layout.w;
  const uint8_t* gaps = layout.gaps;
  const uint64_t gap_mask = w == 32 ? 0xFFFFFFFFull : ((uint64_t{1} << w) - 1);
  uint64_t next = 0;
  if (nnz >= 8) {
    for (uint64_t j = 0, bit = 0; j < nnz; ++j, bit += w) {
      uint64_t word;
      std::memcpy(&word, gaps + bit / 8, sizeof word);
      const uint64_t i = next + ((word >> (bit % 8)) & gap_mask);
      if (!fn(j, i)) return;
      next = i + 1;
    }
  } else {
    BitReader reader(gaps);
    for (uint64_t j = 0; j < nnz; ++j) {
      const uint64_t i = next + reader.get(w);
      if (!fn(j, i)) return;
      next = i + 1;
    }
  }
}

}  // namespace

Status decodeSparsePayload(std::span<const uint8_t> payload, CodecId codec, float weight,
                           float* out, size_t out_elements) {
  auto layout = parseSparsePayload(payload, codec, out_elements);
  if (!layout) return layout.status();
  if (layout->dense) return decodeDenseF32(payload, layout->header, weight, out);
  const std::string name = codecIdName(codec);
  const uint64_t n = layout->header.elements, nnz = layout->nnz;
  auto forEachIndex = [&](auto&& fn) { forEachGapIndex(*layout, fn); };

  // First pass: every index must be < n. Gaps are non-negative, so indices strictly increase
  // and only the last one needs the check; the message names the first entry outside.
  uint64_t last = 0;
  forEachIndex([&](uint64_t, uint64_t i) {
    last = i;
    return true;
  });
  if (nnz > 0 && last >= n) {
    Status bad = Status::ok();
    forEachIndex([&](uint64_t j, uint64_t i) {
      if (i < n) return true;
      bad = dataLoss(name + " payload index " + std::to_string(i) + " (entry " + std::to_string(j) +
                     ") is outside the chunk of " + std::to_string(n) + " elements");
      return false;
    });
    return bad;
  }

  // Second pass: validated, so add.
  const uint8_t* vals = layout->values;
  if (layout->value_bytes == 2) {
    forEachIndex([&](uint64_t j, uint64_t i) {
      out[i] = out[i] + weight * halfToFloat(loadU16(vals + 2 * j));
      return true;
    });
  } else {
    forEachIndex([&](uint64_t j, uint64_t i) {
      out[i] = out[i] + weight * loadF32(vals + 4 * j);
      return true;
    });
  }
  return Status::ok();
}

Status readSparseEntries(std::span<const uint8_t> payload, CodecId codec, size_t out_elements,
                         std::vector<uint32_t>& indices, std::vector<float>& values) {
  auto layout = parseSparsePayload(payload, codec, out_elements);
  if (!layout) return layout.status();
  indices.clear();
  values.clear();
  const uint64_t n = layout->header.elements;
  if (layout->dense) {
    const uint8_t* vals = payload.data() + kHeaderBytes;
    indices.resize(n);
    values.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      indices[i] = static_cast<uint32_t>(i);
      values[i] = loadF32(vals + 4 * i);
    }
    return Status::ok();
  }
  indices.reserve(layout->nnz);
  values.reserve(layout->nnz);
  uint64_t bad = 0;
  forEachGapIndex(*layout, [&](uint64_t, uint64_t i) {
    if (i >= n) {
      bad = i + 1;
      return false;
    }
    indices.push_back(static_cast<uint32_t>(i));
    return true;
  });
  if (bad != 0) {
    return dataLoss(codecIdName(codec) + " payload index " + std::to_string(bad - 1) +
                    " is outside the chunk of " + std::to_string(n) + " elements");
  }
  const uint8_t* vals = layout->values;
  for (uint64_t j = 0; j < layout->nnz; ++j) {
    values.push_back(layout->value_bytes == 2 ? halfToFloat(loadU16(vals + 2 * j))
                                              : loadF32(vals + 4 * j));
  }
  return Status::ok();
}

Result<size_t> writeGlobalSelection(CodecId codec, std::span<const float> sums, size_t k,
                                    uint32_t min_key, std::vector<uint64_t>& scratch,
                                    std::span<uint8_t> out) {
  const size_t len = sums.size();
  if (len > size_t{0xFFFFFFFFu}) return internalError("global selection of 2^32 or more elements");
  // Candidates as composite keys: key(sum) in the high word, the complement of the index in the
  // low one, so that a larger composite is a larger key, then a lower index.
  scratch.clear();
  const uint32_t floor = std::max(min_key, uint32_t{1});  // +-0 (key 0): nothing to carry
  for (size_t i = 0; i < len; ++i) {
    const uint32_t key = magnitudeKey(sums[i]);
    if (key < floor) continue;
    scratch.push_back((uint64_t{key} << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i)));
  }
  if (scratch.size() > k) {
    std::nth_element(scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(k),
                     scratch.end(), std::greater<uint64_t>());
    scratch.resize(k);
  }
  // The selected indices, ascending (a buffer kept per thread: no allocation per chunk).
  thread_local std::vector<uint32_t> list;
  list.resize(scratch.size());
  for (size_t j = 0; j < scratch.size(); ++j) {
    list[j] = 0xFFFFFFFFu - static_cast<uint32_t>(scratch[j]);
  }
  std::sort(list.begin(), list.end());
  auto written =
      writeSparsePayloadFromList(codec, DType::kF32, DType::kF32, list,
                                 ConstTensor{sums.data(), len, DType::kF32}, 0, len, nullptr, out);
  if (!written) return written.status();
  return written->bytes;
}

Result<size_t> sparseEntryCount(std::span<const uint8_t> payload, CodecId codec, size_t len) {
  auto layout = parseSparsePayload(payload, codec, len);
  if (!layout) return layout.status();
  return static_cast<size_t>(layout->dense ? layout->header.elements : layout->nnz);
}

Result<uint64_t> sparseLayerEntries(std::span<const std::span<const uint8_t>> payloads,
                                    CodecId codec, const Chunking& chunking) {
  if (payloads.size() != chunking.count()) {
    return internalError("sparseLayerEntries: " + std::to_string(payloads.size()) +
                         " payloads for " + std::to_string(chunking.count()) + " chunks");
  }
  uint64_t entries = 0;
  for (size_t c = 0; c < payloads.size(); ++c) {
    auto count = sparseEntryCount(payloads[c], codec, chunking.size(c));
    if (!count) return count.status();
    entries += *count;
  }
  return entries;
}

Result<size_t> reduceSelectChunk(const Codec& codec,
                                 std::span<const std::span<const uint8_t>> contributions,
                                 size_t len, const LayerCounts& layer, std::vector<float>& sums,
                                 std::vector<uint64_t>& scratch, std::span<uint8_t> out) {
  const size_t world = contributions.size();
  if (world == 0) return internalError("a global selection of no contributions");
  const uint32_t min_key = codec.globalMinKey(static_cast<uint32_t>(world));
  // The chunk's share of k: its part of the entries the ranks sent for the layer (threshold: no
  // count).
  size_t share = len;
  if (min_key == 0) {
    if (layer.entries.size() != world) {
      return internalError("a global selection of " + std::to_string(world) +
                           " contributions with the layer counts of " +
                           std::to_string(layer.entries.size()) + " ranks");
    }
    uint64_t chunk_entries = 0, layer_entries = 0;
    for (size_t r = 0; r < world; ++r) {
      auto count = sparseEntryCount(contributions[r], codec.traits().id, len);
      if (!count) {
        return Status(count.status().code(),
                      "payload of rank " + std::to_string(r) + ": " + count.status().message());
      }
      if (*count > layer.entries[r]) {
        return dataLoss("payload of rank " + std::to_string(r) + " holds " +
                        std::to_string(*count) + " entries, more than the " +
                        std::to_string(layer.entries[r]) + " its rank sent for the whole layer");
      }
      chunk_entries += *count;
      layer_entries += layer.entries[r];
    }
    const uint64_t cap = std::min<uint64_t>(layer.k, layer_entries / world);
    share = layer_entries == 0 ? 0
                               : static_cast<size_t>(static_cast<unsigned __int128>(chunk_entries) *
                                                     cap / layer_entries);
  }
  sums.assign(len, 0.0f);
  for (size_t r = 0; r < world; ++r) {
    const Status s = r == 0 ? codec.decodeChunkInto(contributions[r], 1.0f, sums.data(), len)
                            : codec.decodeChunk(contributions[r], 1.0f, sums.data(), len);
    if (!s.isOk())
      return Status(s.code(), "payload of rank " + std::to_string(r) + ": " + s.message());
  }
  return writeGlobalSelection(codec.traits().id, sums, share, min_key, scratch, out);
}

Status forEachSettled(CodecId codec, std::span<const uint8_t> sent,
                      std::span<const uint8_t> selected, size_t len,
                      const std::function<void(size_t, float)>& fn) {
  thread_local std::vector<uint32_t> sent_idx, sel_idx;
  thread_local std::vector<float> sent_val, sel_val;
  LW_RETURN_IF_ERROR(readSparseEntries(sent, codec, len, sent_idx, sent_val));
  LW_RETURN_IF_ERROR(readSparseEntries(selected, codec, len, sel_idx, sel_val));
  // Both ascending: one merge.
  size_t b = 0;
  for (size_t a = 0; a < sent_idx.size(); ++a) {
    while (b < sel_idx.size() && sel_idx[b] < sent_idx[a]) ++b;
    if (b == sel_idx.size()) break;
    if (sel_idx[b] == sent_idx[a]) fn(sent_idx[a], sent_val[a]);
  }
  return Status::ok();
}

}  // namespace lightwire::kernels
