#include "proxy/peer/collective.h"

#include "kernels/registry.h"
#include "kernels/select.h"
#include "proxy/peer/mailbox.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <queue>
#include <string>

namespace lightwire::proxy::peer {
namespace {

using Clock = std::chrono::steady_clock;
using Spans = std::vector<std::vector<std::span<const uint8_t>>>;

constexpr uint8_t kPhaseReduce = 0;
constexpr uint8_t kPhaseGather = 1;
constexpr uint8_t kPhaseChecksum = 2;
constexpr uint8_t kPhaseStats = 3;   // the statistics of the ranks so far (chunk 0), of all (1)
constexpr uint8_t kPhaseBucket = 4;  // a rank's bucket header (layout hash), to every other rank
constexpr uint8_t kPhaseContribute = 5;  // sparse allreduce: a rank's payload, to the chunk's owner
constexpr uint8_t kPhaseSelected = 6;    // ... the owner's global selection, to every other rank
constexpr uint8_t kPhaseCount = 7;  // ... a rank's entries of a layer of several regions, to owners
constexpr uint8_t kPhaseWaiting = 9;  // a rank still waiting at half the deadline, and on whom
// u64 layout hash, u32 layers, u64 owners proposed (XXH3-64 of them; 0: none), little-endian
constexpr size_t kBucketHeaderBytes = 20;
// Buckets whose last selections a rank keeps as the weights of their next pass's owners; beyond
// it the one measured longest ago is forgotten (its next pass takes rank (c + h) mod W).
constexpr size_t kMaxBalanced = 4096;
constexpr uint32_t kStatsRecords = 0;  // statistics frame chunk: the sender's records, to 0
constexpr uint32_t kStatsFinal = 1;    // ... the fold of every rank's, from rank 0 both ways
// A rank's entries of a whole layer (u64, little-endian): the first bytes of a contribution to a
// layer of one region (its payload of the chunk follows), the body of a count frame otherwise.
constexpr size_t kContributionCountBytes = 8;

FrameKey keyOf(uint64_t tensor, const ExchangeRound& r, uint8_t phase, uint32_t chunk,
               uint32_t origin) {
  FrameKey k;
  k.tensor = tensor;
  k.step = r.step;
  k.round = static_cast<uint8_t>(r.round);
  k.phase = phase;
  k.chunk = chunk;
  k.origin = origin;
  return k;
}

void putU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

}  // namespace

std::vector<uint8_t> packStatsEntries(const std::vector<std::vector<uint8_t>>& entries) {
  std::vector<uint8_t> out;
  putU32(out, static_cast<uint32_t>(entries.size()));
  for (const auto& e : entries) {
    putU32(out, static_cast<uint32_t>(e.size()));
    out.insert(out.end(), e.begin(), e.end());
  }
  return out;
}

Result<std::vector<std::span<const uint8_t>>> unpackStatsEntries(std::span<const uint8_t> bytes,
                                                                 size_t expected) {
  size_t pos = 0;
  auto u32 = [&](uint32_t& v) {
    if (bytes.size() - pos < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{bytes[pos + static_cast<size_t>(i)]} << (8 * i);
    pos += 4;
    return true;
  };
  uint32_t count = 0;
  if (!u32(count)) return dataLoss("truncated");
  if (count != expected) {
    return dataLoss(std::to_string(count) + " tensors' statistics, this pass has " +
                    std::to_string(expected));
  }
  std::vector<std::span<const uint8_t>> out;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t len = 0;
    if (!u32(len) || bytes.size() - pos < len) return dataLoss("truncated");
    out.push_back(bytes.subspan(pos, len));
    pos += len;
  }
  if (pos != bytes.size()) return dataLoss("trailing bytes");
  return out;
}

uint64_t tensorKey(const std::string& name) { return XXH3_64bits(name.data(), name.size()); }

namespace {

/// Whether the ring adds round `r`'s own values (ExchangeRound::raw) instead of its payloads.
bool useRaw(const ExchangeRound& r) {
  return r.raw && r.round == 0 && r.codec.traits().id == kernels::CodecId::kNone;
}

}  // namespace

RingExchange::RingExchange(Transport& transport, std::chrono::milliseconds timeout)
    : transport_(transport), timeout_(timeout) {}

Status RingExchange::fail(uint64_t tensor, uint64_t step, Status s) {
  transport_.abortStep(tensor, step, s.message());
  return s;
}

Result<std::vector<uint32_t>> RingExchange::compareResults(const std::string& name, uint64_t step,
                                                           uint64_t checksum) {
  // A ring allgather of one 8-byte checksum per rank (phase 2 of the step's frames).
  const uint64_t tensor = tensorKey(name);
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  const uint32_t next = (me + 1) % w, prev = (me + w - 1) % w;
  const auto deadline = Clock::now() + timeout_;
  auto key = [&](uint32_t origin) {
    FrameKey k;
    k.tensor = tensor;
    k.step = step;
    k.round = 0xFF;  // after every codec round
    k.phase = kPhaseChecksum;
    k.origin = origin;
    return k;
  };
  uint8_t mine[8];
  for (int i = 0; i < 8; ++i) mine[i] = static_cast<uint8_t>(checksum >> (8 * i));
  auto fail = [&](Status s) {
    transport_.abortStep(tensor, step, s.message());
    return s;
  };
  if (auto s = transport_.send(next, FrameType::kData, key(me), 0, mine, deadline); !s.isOk()) {
    return fail(s);
  }
  std::vector<uint32_t> differ;
  for (uint32_t h = 1; h < w; ++h) {
    const uint32_t origin = (me + w - h) % w;
    auto got = transport_.receive(prev, key(origin), deadline);
    if (!got) return fail(got.status());
    if (got->payload.size() != 8) {
      return fail(dataLoss("result checksum from rank " + std::to_string(origin) + " has " +
                           std::to_string(got->payload.size()) + " bytes, not 8"));
    }
    if (std::memcmp(got->payload.data(), mine, 8) != 0) differ.push_back(origin);
    if (h + 1 < w) {
      if (auto s = transport_.send(next, FrameType::kData, key(origin), 0, got->payload, deadline);
          !s.isOk()) {
        return fail(s);
      }
    }
    transport_.recycle(std::move(got->payload));  // written (send returns once it is)
  }
  std::sort(differ.begin(), differ.end());
  return differ;
}

void RingExchange::abort(const std::string& tensor, uint64_t step, const std::string& reason) {
  transport_.abortStep(tensorKey(tensor), step, reason);
}

void RingExchange::stepDone(const std::string& tensor, uint64_t step) {
  transport_.discard(tensorKey(tensor), step);
  for (auto& b : held_) transport_.recycle(std::move(b));
  held_.clear();
  for (auto& b : sums_) transport_.recycle(std::move(b));
  sums_.clear();
  for (const auto& [key, s] : buckets_) transport_.discard(key, s);
  buckets_.clear();
  dense_rounds_.clear();
  dense_spans_.clear();
  dense_payloads_.clear();
  dense_inputs_.clear();
}

FrameKey RingExchange::chainKey(uint32_t chunk, uint32_t origin) const {
  FrameKey k = chain_.key;
  k.chunk = chunk;
  k.origin = origin;
  return k;
}

Status RingExchange::statsBegin(std::span<const Item> items, uint64_t step) {
  chain_.rounds.clear();
  chain_.wait = Chain::Wait::kNothing;
  chain_.final.clear();
  for (const Item& it : items) {
    if (it.r->round != 0 || it.r->stats_out.empty()) continue;
    if (!it.r->stats_fold) {
      return internalError("tensor '" + it.r->tensor + "': a statistics record without a fold");
    }
    if (chain_.rounds.empty()) {
      chain_.key = FrameKey{};
      chain_.key.tensor = it.tensor;
      chain_.key.step = step;
      chain_.key.phase = kPhaseStats;
    }
    chain_.rounds.push_back(it.r);
  }
  if (chain_.rounds.empty()) return Status::ok();
  std::vector<std::span<const uint8_t>> own;
  for (const ExchangeRound* r : chain_.rounds) own.push_back(r->stats_out);
  const uint32_t me = transport_.rank();
  if (me != 0) {  // our records to rank 0, at once; then the fold of all, once it is made
    std::vector<std::vector<uint8_t>> records;
    for (auto rec : own) records.emplace_back(rec.begin(), rec.end());
    chain_.out = packStatsEntries(records);  // lent to post() until the flush
    chain_.wait = Chain::Wait::kFinal;
    return transport_.post(0, FrameType::kData, chainKey(kStatsRecords, me), 0, chain_.out,
                           deadline_);
  }
  chain_.partial.assign(chain_.rounds.size(), {});
  return statsFold(0, own);  // rank 0 folds, its own record first
}

namespace {

// The fold of every rank's records leaves rank 0 both ways round the ring and stops where the
// two ways meet (docs/exchange.md "Policy statistics"): ranks 1 .. m receive it from their
// predecessor, ranks W-1 .. m+1 from their successor, m = ⌈(W-1)/2⌉.
uint32_t meeting(uint32_t w) { return w / 2; }  // ⌈(W-1)/2⌉
uint32_t finalSource(uint32_t me, uint32_t w) { return me <= meeting(w) ? me - 1 : (me + 1) % w; }
/// Where a rank other than 0 passes the fold of all on (none: where the ways meet).
std::optional<uint32_t> finalNext(uint32_t me, uint32_t w) {
  const uint32_t m = meeting(w);
  if (me < m) return me + 1;
  if (me > m + 1) return me - 1;
  return std::nullopt;
}

}  // namespace

Status RingExchange::statsFold(uint32_t rank, std::span<const std::span<const uint8_t>> records) {
  const uint32_t w = transport_.worldSize();
  for (size_t i = 0; i < chain_.rounds.size(); ++i) {
    const ExchangeRound& r = *chain_.rounds[i];
    auto f = r.stats_fold(chain_.partial[i], records[i], rank);
    if (!f) {
      return dataLoss("the statistics record of rank " + std::to_string(rank) + " (tensor '" +
                      r.tensor + "'): " + f.status().message());
    }
    chain_.partial[i] = std::move(*f);
  }
  chain_.next = rank + 1;
  if (chain_.next < w) {
    chain_.wait = Chain::Wait::kRecords;
    return Status::ok();
  }
  // Every rank's records folded: the fold of all, both ways round.
  chain_.final = std::move(chain_.partial);
  chain_.wait = Chain::Wait::kNothing;
  chain_.out = packStatsEntries(chain_.final);  // lent to post() until the flush
  if (w > 1) {
    LW_RETURN_IF_ERROR(
        transport_.post(1, FrameType::kData, chainKey(kStatsFinal, 0), 0, chain_.out, deadline_));
  }
  if (w - 1 > meeting(w)) {  // W >= 3: the other way too
    LW_RETURN_IF_ERROR(transport_.post(w - 1, FrameType::kData, chainKey(kStatsFinal, 0), 0,
                                       chain_.out, deadline_));
  }
  return Status::ok();
}

std::optional<Wake> RingExchange::statsAwaited() const {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  switch (chain_.wait) {
    case Chain::Wait::kRecords:
      return Wake{chain_.next, chainKey(kStatsRecords, chain_.next)};
    case Chain::Wait::kFinal: {
      const uint32_t src = finalSource(me, w);
      return Wake{src, chainKey(kStatsFinal, src)};
    }
    case Chain::Wait::kNothing:
      break;
  }
  return std::nullopt;
}

Status RingExchange::statsAdvance(bool block) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  while (auto awaited = statsAwaited()) {
    const bool records = chain_.wait == Chain::Wait::kRecords;
    const uint32_t src = awaited->src;
    Result<Frame> got = internalError("not received");
    if (!block) {
      got = transport_.receive(src, awaited->key, Clock::now());
    } else if (auto waited = waitFor(src, awaited->key, nullptr); !waited) {
      got = waited.status();
    } else {
      got = std::move(**waited);  // no wake: a frame
    }
    if (!got) {
      if (!block) return Status::ok();  // not there yet: the next wait tries again
      return Status(
          got.status().code(),
          (records ? "waiting for rank " + std::to_string(src) + "'s statistics record"
                   : "waiting for the statistics of every rank from rank " + std::to_string(src)) +
              ": " + got.status().message());
    }
    const auto bytes = keep(std::move(got->payload));
    auto entries = unpackStatsEntries(bytes, chain_.rounds.size());
    if (records) {
      if (!entries) {
        return dataLoss("the statistics record of rank " + std::to_string(src) + ": " +
                        entries.status().message());
      }
      LW_RETURN_IF_ERROR(statsFold(src, *entries));
      continue;
    }
    if (!entries) {
      return dataLoss("the statistics of every rank from rank " + std::to_string(src) + ": " +
                      entries.status().message());
    }
    for (const auto& e : *entries) chain_.final.emplace_back(e.begin(), e.end());
    chain_.wait = Chain::Wait::kNothing;
    if (auto to = finalNext(me, w)) {
      LW_RETURN_IF_ERROR(
          transport_.post(*to, FrameType::kData, chainKey(kStatsFinal, me), 0, bytes, deadline_));
    }
  }
  return Status::ok();
}

Result<Frame> RingExchange::take(uint32_t src, const FrameKey& key) {
  for (;;) {
    LW_RETURN_IF_ERROR(statsAdvance(false));
    // While the statistics wait for a frame, its arrival ends this wait too: it is folded or
    // passed on at once, and the wait resumes.
    const std::optional<Wake> wake = statsAwaited();
    auto got = waitFor(src, key, wake ? &*wake : nullptr);
    if (!got) return got.status();
    if (*got) return std::move(**got);
  }
}

Result<std::optional<Frame>> RingExchange::waitFor(uint32_t src, const FrameKey& key,
                                                   const Wake* wake) {
  waiting_on_ = src;
  auto receive = [&](Clock::time_point until) -> Result<std::optional<Frame>> {
    if (wake) return transport_.receiveOrWake(src, key, *wake, until);
    auto got = transport_.receive(src, key, until);
    if (!got) return got.status();
    return std::optional<Frame>(std::move(*got));
  };
  if (Clock::now() < halfway_) {
    auto got = receive(halfway_);
    if (got || Clock::now() < halfway_) return got;
  }
  if (!told_waiting_[src] && Clock::now() < deadline_) {
    // Still waiting at half the deadline: every peer is told on whom (docs/exchange.md
    // "Failure"), so a rank whose deadline passes can follow the waits to the silent rank.
    told_waiting_[src] = 1;
    const uint32_t w = transport_.worldSize(), me = transport_.rank();
    auto& note = waiting_notes_.emplace_back();
    putU32(note, src);
    FrameKey k = pass_key_;
    k.phase = kPhaseWaiting;
    k.chunk = notes_sent_++;
    k.origin = me;
    for (uint32_t r = 0; r < w; ++r) {
      if (r != me) (void)transport_.post(r, FrameType::kData, k, 0, note, deadline_);
    }
  }
  return receive(deadline_);
}

Status RingExchange::nameSilent(Status failed) {
  if (Clock::now() < deadline_ || !waiting_on_) return failed;
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  // The last rank each rank said it was waiting on (its notes come in order, chunk 0, 1, ...).
  std::optional<Status> aborted;  // a peer gave the step up meanwhile: its reason names more
  auto waitsOn = [&](uint32_t rank) -> std::optional<uint32_t> {
    std::optional<uint32_t> on;
    FrameKey k = pass_key_;
    k.phase = kPhaseWaiting;
    k.origin = rank;
    for (k.chunk = 0; k.chunk < w; ++k.chunk) {
      auto got = transport_.receive(rank, k, Clock::now());
      if (!got && got.status().code() == StatusCode::kAborted) aborted = got.status();
      if (!got) break;
      if (got->payload.size() == 4) {
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i) v |= uint32_t{got->payload[static_cast<size_t>(i)]} << (8 * i);
        if (v < w) on = v;
      }
      transport_.recycle(std::move(got->payload));
    }
    return on;
  };
  std::vector<char> seen(w, 0);
  seen[me] = 1;
  std::vector<uint32_t> path{*waiting_on_};
  seen[*waiting_on_] = 1;
  for (auto on = waitsOn(path.back()); on && !seen[*on]; on = waitsOn(path.back())) {
    seen[*on] = 1;
    path.push_back(*on);
  }
  if (aborted) return Status(failed.code(), failed.message() + "; " + aborted->message());
  if (path.size() < 2) return failed;
  std::string chain;
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    chain += fmt::format("{}rank {} waits for rank {}", i ? ", " : "", path[i], path[i + 1]);
  }
  return Status(failed.code(), failed.message() + "; " + chain + ", which has not answered " +
                                   "(silent, or it has not started the step)");
}

Result<Spans> RingExchange::run(ExchangeRound& r) {
  ExchangeRound* one[] = {&r};
  auto got = runAll(one, nullptr);
  if (!got) return got.status();
  return std::move(got->front());
}

Result<std::vector<Spans>> RingExchange::runAll(std::span<ExchangeRound* const> rounds,
                                                const BucketTag* bucket) {
  const auto start = Clock::now();
  deadline_ = start + timeout_;
  halfway_ = start + timeout_ / 2;
  const size_t n = rounds.size();
  waiting_on_.reset();
  told_waiting_.assign(transport_.worldSize(), 0);
  waiting_notes_.clear();
  notes_sent_ = 0;
  std::vector<Item> items(n);
  for (size_t i = 0; i < n; ++i) {
    ExchangeRound& r = *rounds[i];
    items[i] = {&r, tensorKey(r.tensor)};
    if (r.round == 0) transport_.beginStep(items[i].tensor, r.step);
    r.stats_in.clear();
    r.stats_folded = false;
  }
  // Every tensor of the pass fails with the first error, and is aborted on every peer.
  const uint64_t step = n > 0 ? rounds[0]->step : 0;
  pass_key_ = FrameKey{};
  pass_key_.tensor = n > 0 ? items[0].tensor : 0;
  pass_key_.step = step;
  if (bucket) {
    buckets_.emplace_back(tensorKey(bucket->name), step);
    transport_.beginStep(buckets_.back().first, step);
  }
  auto failAll = [&](Status s) {
    for (const Item& it : items) transport_.abortStep(it.tensor, it.r->step, s.message());
    if (bucket) transport_.abortStep(tensorKey(bucket->name), step, s.message());
    return s;
  };
  // Statistics records (round 0): expected from every rank iff this rank has one (the engine
  // gives every rank of a job one, or none). Every rank's go to rank 0 at once, which folds them
  // as they arrive — while the data exchange waits (take()), and after it — and sends the fold of
  // all both ways round the ring.
  for (const Item& it : items) {
    if (it.r->round == 0 && it.r->stats_out.size() > kMaxStatsBytes) {
      return failAll(invalidArgument("this sidecar's statistics record has " +
                                     std::to_string(it.r->stats_out.size()) + " bytes, more than " +
                                     std::to_string(kMaxStatsBytes) + " (tensor '" + it.r->tensor +
                                     "')"));
    }
  }
  // The sparse allreduce's rounds, and their owners, proposed in the bucket's header.
  std::vector<Item> reduce, gather, select;
  for (const Item& it : items) {
    if (it.r->select_globally && it.r->codec.selectsGlobally() && it.r->round == 0) {
      select.push_back(it);
    }
  }
  planOwners(select, bucket, step);
  bucket_checked_ = false;
  Status st = bucket ? postBucket(*bucket, step) : Status::ok();
  if (st.isOk()) st = statsBegin(items, step);
  // Which collective each other tensor takes; the sparse ones that would move more bytes gathered
  // than a dense allreduce go dense (their own payloads decoded, summed as codec `none`).
  for (Item& it : items) {
    const auto& traits = it.r->codec.traits();
    if (it.r->select_globally) {
      if ((!it.r->codec.selectsGlobally() || it.r->round != 0) && st.isOk()) {
        st = internalError("tensor '" + it.r->tensor + "': codec " + traits.name +
                           " cannot be selected globally");
      }
      continue;  // in `select` when it can be
    } else if (traits.summable || traits.rounds > 1) {
      reduce.push_back(it);
    } else if (denseIsSmaller(*it.r)) {
      auto dense = denseRound(*it.r);
      if (!dense) {
        if (st.isOk()) st = dense.status();
        continue;
      }
      reduce.push_back({*dense, it.tensor});
    } else {
      gather.push_back(it);
    }
  }
  // by_origin[k][c][o]: rank o's payload of chunk c of gather[k]; reduced[k]: reduce[k]'s sums.
  std::vector<Spans> by_origin, reduced, selected;
  std::vector<uint64_t> select_entries;  // this rank's entries of each of select's layers
  // The gathers' and the sparse allreduces' own payloads go out first, then (once every rank's
  // layout is known to be this one's) the allreduces run, then the owners' selections, then the
  // gathers' hops.
  // A stage's result into `out`, or its error into `st`.
  auto into = [&st](auto got, auto& out) {
    if (got) {
      out = std::move(*got);
    } else {
      st = got.status();
    }
  };
  if (st.isOk()) st = gatherPost(gather, by_origin);
  if (st.isOk()) into(sparsePost(select, bucket, step), select_entries);
  if (st.isOk() && bucket && !bucket_checked_) st = checkBucket(*bucket, step);
  if (st.isOk()) into(allreduce(reduce), reduced);
  if (st.isOk()) into(sparseReduce(select, select_entries), selected);
  if (st.isOk()) st = gatherReceive(gather, by_origin);
  if (st.isOk()) st = statsAdvance(true);  // what is left of the statistics' way round
  // Frames were post()ed: they reference this step's payloads (and the statistics) until
  // flushed, success or not.
  const Status flushed = transport_.flush(deadline_);
  if (!st.isOk() || !flushed.isOk()) return failAll(nameSilent(!st.isOk() ? st : flushed));
  for (size_t i = 0; i < chain_.rounds.size(); ++i) {
    chain_.rounds[i]->stats_in.push_back(std::move(chain_.final[i]));
    chain_.rounds[i]->stats_folded = true;
  }
  if (bucket) rememberSelections(select, selected, *bucket, step);
  // In the order given: each tensor's sums, or every rank's payloads (decoded in rank order: the
  // same arithmetic on every rank).
  std::vector<Spans> out(n);
  size_t next_reduce = 0, next_gather = 0, next_select = 0;
  for (size_t i = 0; i < n; ++i) {
    if (next_gather < gather.size() && gather[next_gather].r == rounds[i]) {
      out[i] = std::move(by_origin[next_gather++]);
    } else if (next_select < select.size() && select[next_select].r == rounds[i]) {
      out[i] = std::move(selected[next_select++]);
    } else {
      out[i] = std::move(reduced[next_reduce++]);
    }
  }
  return out;
}

bool RingExchange::denseIsSmaller(const ExchangeRound& r) const {
  // Each rank sends W-1 payloads in an allgather, 2(W-1)/W dense chunks in a ring allreduce:
  // gather while W * payload <= 2 * dense. Decided from the configuration (nominal sizes), so
  // every rank decides the same; codecs whose size cannot be told in advance always gather.
  const uint64_t w = transport_.worldSize();
  if (w < 2) return false;
  uint64_t gathered = 0, dense = 0;
  for (size_t c = 0; c < r.chunking.count(); ++c) {
    const size_t len = r.chunking.size(c);
    const auto nominal = r.codec.nominalPayloadBytes(len, r.density);
    if (!nominal) return false;
    gathered += *nominal;
    dense += kernels::noneCodec().maxPayloadBytes(len);
  }
  return w * gathered > 2 * dense;
}

Result<ExchangeRound*> RingExchange::denseRound(ExchangeRound& r) {
  // Every rank decodes its own payloads into fp32 and the ring sums those (codec `none`); the
  // engine decodes the sums with the same codec (r.dense). Kept until the step ends.
  const size_t n = r.chunking.elements;
  std::vector<float>& input = dense_inputs_.emplace_back(n, 0.0f);
  for (size_t c = 0; c < r.chunking.count(); ++c) {
    auto own = r.payload(c);
    if (!own) return own.status();
    if (auto s =
            r.codec.decodeChunk(*own, 1.0f, input.data() + r.chunking.begin(c), r.chunking.size(c));
        !s.isOk()) {
      return internalError("decoding our own chunk " + std::to_string(c) + " of '" + r.tensor +
                           "': " + s.message());
    }
  }
  kernels::StepContext ctx;
  kernels::CodecState none_state;
  auto payloads = kernels::encodeTensor(kernels::noneCodec(), ctx, r.chunking,
                                        kernels::ConstTensor{input.data(), n}, none_state);
  if (!payloads) return internalError("dense payloads: " + payloads.status().message());
  auto& bytes = dense_payloads_.emplace_back(std::move(*payloads));
  auto& mine = dense_spans_.emplace_back(bytes.begin(), bytes.end());
  r.dense = true;  // before the allreduce: r.on_chunk decodes these sums as codec `none`
  ExchangeRound& dense = dense_rounds_.emplace_back(
      ExchangeRound{r.tensor, r.step, r.round, kernels::noneCodec(), r.chunking, mine});
  dense.on_chunk = r.on_chunk;
  return &dense;
}

std::span<const uint8_t> RingExchange::keep(std::vector<uint8_t> received) {
  held_.push_back(std::move(received));
  return held_.back();
}

std::vector<uint8_t>& RingExchange::sumBuffer(size_t bytes) {
  sums_.push_back(transport_.takeBuffer(bytes));
  return sums_.back();
}

Result<std::vector<Spans>> RingExchange::allreduce(std::span<const Item> items) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  const uint32_t next = (me + 1) % w, prev = (me + w - 1) % w;
  const Clock::time_point deadline = deadline_;
  // Chunk c of a tensor is owned by rank c mod W. Position of this rank in chunk c's reduction
  // chain owner+1, owner+2, ..., owner.
  auto position = [&](size_t c) { return (me + w - (static_cast<uint32_t>(c % w) + 1) % w) % w; };
  std::vector<Spans> out(items.size());
  for (size_t i = 0; i < items.size(); ++i) out[i].resize(items[i].r->chunking.count());
  auto key = [&](const Item& it, uint8_t phase, size_t c, uint32_t origin) {
    return keyOf(it.tensor, *it.r, phase, static_cast<uint32_t>(c), origin);
  };
  auto send = [&](const Item& it, uint8_t phase, size_t c, std::span<const uint8_t> payload) {
    return transport_.post(next, FrameType::kData, key(it, phase, c, static_cast<uint32_t>(c % w)),
                           static_cast<uint8_t>(it.r->codec.traits().id), payload, deadline);
  };
  // A tensor decoded chunk by chunk (on_chunk) streams: the partial sums, the owners' sums and
  // the gathered sums go to the transport as they are sent and come back once written
  // (postOwned, reclaimed at each chunk), so the ring holds the chunks in flight, not a step's
  // worth of the tensor. Without on_chunk the sums must outlive the call (kept till stepDone).
  auto postOwned = [&](const Item& it, uint8_t phase, size_t c, std::vector<uint8_t> payload) {
    return transport_.postOwned(
        next, FrameType::kData, key(it, phase, c, static_cast<uint32_t>(c % w)),
        static_cast<uint8_t>(it.r->codec.traits().id), std::move(payload), deadline);
  };
  // Codec `none` with its values at hand (ExchangeRound::raw): a position that only adds its own
  // payload adds the values, and the payload is never made.
  for (const Item& it : items) {
    if (useRaw(*it.r)) it.r->raw_used.assign(it.r->chunking.count(), 0);
  }
  // Chains that start here go out first, every tensor's, so every rank has work in flight at once.
  for (const Item& it : items) {
    for (size_t c = 0; c < it.r->chunking.count(); ++c) {
      if (position(c) != 0) continue;
      if (useRaw(*it.r) && it.r->on_chunk && w > 1) {  // the values' payload, made to be sent
        const size_t len = it.r->chunking.size(c);
        std::vector<uint8_t> own = transport_.takeBuffer(kernels::noneCodec().maxPayloadBytes(len));
        own.resize(kernels::writeDensePayload(kernels::ConstTensor{it.r->raw(c), len}, own.data(),
                                              nullptr));
        it.r->raw_used[c] = 1;
        LW_RETURN_IF_ERROR(postOwned(it, kPhaseReduce, c, std::move(own)));
        continue;
      }
      auto own = it.r->payload(c);  // compressed now: the previous chunk is on its way meanwhile
      if (!own) return own.status();
      LW_RETURN_IF_ERROR(send(it, kPhaseReduce, c, *own));
    }
  }
  // Reduce-scatter: add our payload to the partial sum from prev; forward it, or keep it (owner).
  // Chunks are taken in the order of this rank's position in their chains (the ring schedule),
  // over every tensor at each position: position p needs what prev did at position p-1, so every
  // rank works at once; in chunk order, every rank would wait on the same chunk's chain and the
  // ranks would take turns.
  std::vector<std::pair<size_t, size_t>> order;  // (item, chunk)
  for (uint32_t p = 1; p < w; ++p) {
    for (size_t i = 0; i < items.size(); ++i) {
      for (size_t c = 0; c < items[i].r->chunking.count(); ++c) {
        if (position(c) == p) order.emplace_back(i, c);
      }
    }
  }
  for (const auto& [i, c] : order) {
    transport_.reclaim();
    const Item& it = items[i];
    ExchangeRound& r = *it.r;
    const bool stream = static_cast<bool>(r.on_chunk);
    const uint32_t pos = position(c);
    const float* raw = useRaw(r) ? r.raw(c) : nullptr;
    std::span<const uint8_t> own;
    if (raw == nullptr) {
      auto p = r.payload(c);  // compressed before waiting: it overlaps the partial's arrival
      if (!p) return p.status();
      own = *p;
    }
    auto got = take(prev, key(it, kPhaseReduce, c, static_cast<uint32_t>(c % w)));
    if (!got) return got.status();
    // The sum has the addends' size (a summable layout is fixed by the chunk): sized by what
    // arrived, within the codec's bound, not by the bound (PowerSGD's reserves a whole factor).
    const size_t bytes = std::min(r.codec.maxPayloadBytes(r.chunking.size(c)), got->payload.size());
    std::vector<uint8_t> streamed = stream ? transport_.takeBuffer(bytes) : std::vector<uint8_t>{};
    std::vector<uint8_t>& sum = stream ? streamed : sumBuffer(bytes);
    auto size = raw != nullptr ? kernels::addDenseValues(got->payload, raw, r.chunking.size(c), sum)
                               : r.codec.addPayloads(got->payload, own, sum);
    if (raw != nullptr) r.raw_used[c] = 1;
    transport_.recycle(std::move(got->payload));
    if (!size) {
      return dataLoss("chunk " + std::to_string(c) + " of '" + r.tensor + "' from rank " +
                      std::to_string(prev) + " does not add up: " + size.status().message());
    }
    const std::span<const uint8_t> partial(sum.data(), *size);
    const uint8_t phase = pos + 1 < w ? kPhaseReduce : kPhaseGather;
    if (stream) {
      streamed.resize(*size);  // `partial` stays valid till the next reclaim()
      LW_RETURN_IF_ERROR(postOwned(it, phase, c, std::move(streamed)));
    } else {
      LW_RETURN_IF_ERROR(send(it, phase, c, partial));
    }
    if (phase == kPhaseGather) {  // this rank owns chunk c: the sum is complete
      out[i][c].push_back(partial);
      if (stream) {
        LW_RETURN_IF_ERROR(r.on_chunk(c, out[i][c]));
        out[i][c].clear();  // decoded: its buffer goes back at the next reclaim()
      }
    }
  }
  if (w == 1) {
    for (size_t i = 0; i < items.size(); ++i) {
      for (size_t c = 0; c < items[i].r->chunking.count(); ++c) {
        auto own = items[i].r->payload(c);
        if (!own) return own.status();
        out[i][c].push_back(*own);
      }
    }
    return out;
  }
  // Allgather: the owners' sums travel on around the ring, nearest owners first (same reason).
  order.clear();
  for (uint32_t d = 1; d < w; ++d) {
    for (size_t i = 0; i < items.size(); ++i) {
      for (size_t c = 0; c < items[i].r->chunking.count(); ++c) {
        if ((me + w - static_cast<uint32_t>(c % w)) % w == d) order.emplace_back(i, c);
      }
    }
  }
  for (const auto& [i, c] : order) {
    transport_.reclaim();
    const Item& it = items[i];
    const uint32_t owner = static_cast<uint32_t>(c % w);
    auto got = take(prev, key(it, kPhaseGather, c, owner));
    if (!got) return got.status();
    if (!it.r->on_chunk) {
      const auto sum = keep(std::move(got->payload));
      out[i][c].push_back(sum);
      if (next != owner) LW_RETURN_IF_ERROR(send(it, kPhaseGather, c, sum));
      continue;
    }
    const std::span<const uint8_t> sum = got->payload;  // valid till the next reclaim()
    out[i][c].push_back(sum);
    if (next != owner) {
      LW_RETURN_IF_ERROR(postOwned(it, kPhaseGather, c, std::move(got->payload)));
    }
    LW_RETURN_IF_ERROR(it.r->on_chunk(c, out[i][c]));
    out[i][c].clear();
    if (next == owner) transport_.recycle(std::move(got->payload));
  }
  transport_.reclaim();
  return out;
}

Status RingExchange::postBucket(const BucketTag& bucket, uint64_t step) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  kernels::storeU64(header_, bucket.layout_hash);
  kernels::storeU32(header_ + 8, bucket.layers);
  kernels::storeU64(header_ + 12, proposal_);
  FrameKey k;
  k.tensor = tensorKey(bucket.name);
  k.step = step;
  k.phase = kPhaseBucket;
  k.origin = me;
  for (uint32_t r = 0; r < w; ++r) {
    if (r == me) continue;
    LW_RETURN_IF_ERROR(transport_.post(r, FrameType::kData, k, 0, header_, deadline_));
  }
  return Status::ok();
}

Status RingExchange::checkBucket(const BucketTag& bucket, uint64_t step) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  std::string differ;
  bool agreed = proposal_ != 0;
  bucket_checked_ = true;
  for (uint32_t r = 0; r < w; ++r) {
    if (r == me) continue;
    FrameKey k;
    k.tensor = tensorKey(bucket.name);
    k.step = step;
    k.phase = kPhaseBucket;
    k.origin = r;
    auto got = take(r, k);
    if (!got) {
      return Status(got.status().code(), "waiting for rank " + std::to_string(r) +
                                             "'s layout of bucket '" + bucket.name +
                                             "': " + got.status().message());
    }
    std::vector<uint8_t> b = std::move(got->payload);
    if (b.size() != kBucketHeaderBytes) {
      const size_t size = b.size();
      transport_.recycle(std::move(b));
      return dataLoss("rank " + std::to_string(r) + "'s header of bucket '" + bucket.name +
                      "' has " + std::to_string(size) + " bytes, not " +
                      std::to_string(kBucketHeaderBytes));
    }
    const uint64_t hash = kernels::loadU64(b.data());
    const uint32_t layers = kernels::loadU32(b.data() + 8);
    // Balanced owners only when every rank proposed the same ones: every rank sees every header,
    // so every rank decides alike.
    if (kernels::loadU64(b.data() + 12) != proposal_) agreed = false;
    transport_.recycle(std::move(b));
    if (hash != bucket.layout_hash || layers != bucket.layers) {
      differ += fmt::format("{}rank {} has layout {:016x} ({} layers)", differ.empty() ? "" : ", ",
                            r, hash, layers);
    }
  }
  balanced_ = agreed;
  if (differ.empty()) return Status::ok();
  return failedPrecondition(fmt::format(
      "bucket '{}' step {}: this sidecar's layout is {:016x} ({} layers), {}: every trainer of the "
      "job must send a bucket with the same layout (docs/api.md \"Layouts: one tensor per layer\")",
      bucket.name, step, bucket.layout_hash, bucket.layers, differ));
}

namespace {

/// The owner of chunk c of a sparse allreduce without balanced owners: rank (c + tensor key) mod
/// W, so that the one-chunk layers of a bucket (below 64 Ki elements) spread over the ranks
/// instead of all falling to rank 0.
uint32_t selectionOwner(uint64_t tensor, size_t c, uint32_t w) {
  return static_cast<uint32_t>((tensor % w + c % w) % w);
}

}  // namespace

uint64_t RingExchange::regionsSignature(std::span<const Item> select) const {
  std::vector<uint64_t> sig{transport_.worldSize()};
  for (const Item& it : select) {
    sig.push_back(it.tensor);
    sig.push_back(it.r->chunking.count());
  }
  return XXH3_64bits(sig.data(), sig.size() * sizeof(uint64_t));
}

std::vector<uint32_t> balanceOwners(std::span<const uint64_t> weights, uint32_t world) {
  std::vector<uint32_t> owners(weights.size(), 0);
  if (world == 0) return owners;
  std::vector<size_t> order(weights.size());
  for (size_t u = 0; u < order.size(); ++u) order[u] = u;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return weights[a] > weights[b]; });
  // (load, rank): the least loaded rank on top, the lower rank among equals.
  using Load = std::pair<uint64_t, uint32_t>;
  std::priority_queue<Load, std::vector<Load>, std::greater<>> ranks;
  for (uint32_t r = 0; r < world; ++r) ranks.emplace(0, r);
  for (size_t u : order) {
    auto [load, r] = ranks.top();
    ranks.pop();
    owners[u] = r;
    ranks.emplace(load + weights[u] + 1, r);
  }
  return owners;
}

void RingExchange::planOwners(std::span<const Item> select, const BucketTag* bucket,
                              uint64_t step) {
  const uint32_t w = transport_.worldSize();
  unit_base_.clear();
  fallback_owners_.clear();
  balanced_owners_.clear();
  proposal_ = 0;
  balanced_ = false;
  for (const Item& it : select) {
    unit_base_.push_back(fallback_owners_.size());
    for (size_t c = 0; c < it.r->chunking.count(); ++c) {
      fallback_owners_.push_back(selectionOwner(it.tensor, c, w));
    }
  }
  if (!bucket || select.empty() || w < 2) return;
  const auto found = balance_.find(tensorKey(bucket->name));
  if (found == balance_.end() || found->second.signature != regionsSignature(select) ||
      found->second.step >= step || found->second.weights.size() != fallback_owners_.size()) {
    return;
  }
  balanced_owners_ = balanceOwners(found->second.weights, w);
  std::vector<uint8_t> bytes(balanced_owners_.size() * 4);
  for (size_t u = 0; u < balanced_owners_.size(); ++u) {
    kernels::storeU32(bytes.data() + u * 4, balanced_owners_[u]);
  }
  proposal_ = std::max<uint64_t>(XXH3_64bits(bytes.data(), bytes.size()), 1);
}

void RingExchange::rememberSelections(std::span<const Item> select,
                                      const std::vector<Spans>& selected, const BucketTag& bucket,
                                      uint64_t step) {
  const uint64_t key = tensorKey(bucket.name);
  if (select.empty() || transport_.worldSize() < 2) return;
  std::vector<uint64_t> weights;
  weights.reserve(fallback_owners_.size());
  for (size_t i = 0; i < select.size(); ++i) {
    const ExchangeRound& r = *select[i].r;
    for (size_t c = 0; c < r.chunking.count(); ++c) {
      // Every rank holds the same selection bytes; one it cannot count (the step fails when it
      // is decoded) leaves the bucket without weights.
      auto count = selected[i][c].size() == 1
                       ? kernels::sparseEntryCount(selected[i][c][0], r.codec.traits().id,
                                                   r.chunking.size(c))
                       : Result<size_t>(internalError("not one selection"));
      if (!count) {
        balance_.erase(key);
        return;
      }
      weights.push_back(*count);
    }
  }
  if (balance_.size() >= kMaxBalanced && balance_.find(key) == balance_.end()) {
    balance_.erase(std::min_element(
        balance_.begin(), balance_.end(),
        [](const auto& a, const auto& b) { return a.second.step < b.second.step; }));
  }
  balance_[key] = Balance{regionsSignature(select), step, std::move(weights)};
}

Result<std::vector<uint64_t>> RingExchange::sparsePost(std::span<const Item> items,
                                                       const BucketTag* bucket, uint64_t step) {
  const uint32_t me = transport_.rank();
  std::vector<uint64_t> entries(items.size(), 0);
  std::vector<std::vector<std::span<const uint8_t>>> own(items.size());
  // A layer of one region sends its rank's entries of the layer in the contribution's first 8
  // bytes; a layer of several sends each chunk's payload as soon as it is compressed and the
  // count after its last chunk, in a frame of its own to each owner (docs/exchange.md "Sparse
  // allreduce").
  auto postChunk = [&](size_t i, size_t c) -> Status {
    const ExchangeRound& r = *items[i].r;
    const uint32_t owner = ownerOf(i, c);
    if (owner == me) return Status::ok();
    std::span<const uint8_t> body = own[i][c];
    if (r.chunking.count() == 1) {
      std::vector<uint8_t>& b = sumBuffer(kContributionCountBytes + body.size());
      kernels::storeU64(b.data(), entries[i]);
      if (!body.empty()) std::memcpy(b.data() + kContributionCountBytes, body.data(), body.size());
      body = b;
    }
    return transport_.post(
        owner, FrameType::kData,
        keyOf(items[i].tensor, r, kPhaseContribute, static_cast<uint32_t>(c), me),
        static_cast<uint8_t>(r.codec.traits().id), body, deadline_);
  };
  auto postCount = [&](size_t i) -> Status {
    const ExchangeRound& r = *items[i].r;
    std::vector<uint8_t>& b = sumBuffer(kContributionCountBytes);
    kernels::storeU64(b.data(), entries[i]);
    std::vector<uint8_t> told(transport_.worldSize(), 0);
    for (size_t c = 0; c < r.chunking.count(); ++c) {
      const uint32_t owner = ownerOf(i, c);
      if (owner == me || told[owner]) continue;
      told[owner] = 1;
      LW_RETURN_IF_ERROR(transport_.post(
          owner, FrameType::kData, keyOf(items[i].tensor, r, kPhaseCount, 0, me), 0, b, deadline_));
    }
    return Status::ok();
  };
  auto postLayer = [&](size_t i) -> Status {
    for (size_t c = 0; c < items[i].r->chunking.count(); ++c) LW_RETURN_IF_ERROR(postChunk(i, c));
    return items[i].r->chunking.count() > 1 ? postCount(i) : Status::ok();
  };
  // Balanced owners proposed: known once every rank's header is (docs/exchange.md "Which rank
  // owns a region"). The layers of one region before the first of several are compressed while
  // the headers travel; from that layer on, chunks go out as they are compressed.
  bool owners_known = proposal_ == 0 || bucket == nullptr;
  size_t posted = 0;  // layers whose contributions are out
  for (size_t i = 0; i < items.size(); ++i) {
    const ExchangeRound& r = *items[i].r;
    const bool streamed = r.chunking.count() > 1;
    if (streamed && !owners_known) {
      LW_RETURN_IF_ERROR(checkBucket(*bucket, step));
      owners_known = true;
      for (; posted < i; ++posted) LW_RETURN_IF_ERROR(postLayer(posted));
    }
    for (size_t c = 0; c < r.chunking.count(); ++c) {
      auto p = r.payload(c);
      if (!p) return p.status();
      own[i].push_back(*p);
      if (streamed) LW_RETURN_IF_ERROR(postChunk(i, c));
    }
    auto counted = kernels::sparseLayerEntries(own[i], r.codec.traits().id, r.chunking);
    if (!counted) return counted.status();
    entries[i] = *counted;
    if (owners_known) {
      LW_RETURN_IF_ERROR(streamed ? postCount(i) : postChunk(i, 0));
      posted = i + 1;
    }
  }
  if (!owners_known) {
    LW_RETURN_IF_ERROR(checkBucket(*bucket, step));
    for (; posted < items.size(); ++posted) LW_RETURN_IF_ERROR(postLayer(posted));
  }
  return entries;
}

Result<std::vector<RingExchange::Spans>> RingExchange::sparseReduce(
    std::span<const Item> items, std::span<const uint64_t> own_entries) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  std::vector<Spans> out(items.size());
  // The owned chunks: every rank's contribution, summed in rank order (decoded with weight 1),
  // then the chunk's share of the global selection, to every other rank.
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    ExchangeRound& r = *it.r;
    const size_t chunks = r.chunking.count(), n = r.chunking.elements;
    out[i].resize(chunks);
    std::vector<std::span<const uint8_t>> contributions(w);
    std::vector<uint64_t> entries(w);
    std::vector<uint8_t> counted(w, 0);  // a layer of several regions: the rank's count taken
    const kernels::LayerCounts layer{r.codec.selectionCount(n, r.density), entries};
    // The rank's entries of the layer: at most one per element (the dense escape).
    auto declare = [&](uint32_t k_rank, std::span<const uint8_t> body,
                       const std::string& what) -> Status {
      const uint64_t declared =
          body.size() < kContributionCountBytes ? 0 : kernels::loadU64(body.data());
      if (body.size() >= kContributionCountBytes && declared <= n) {
        entries[k_rank] = declared;
        return Status::ok();
      }
      return dataLoss("rank " + std::to_string(k_rank) + "'s " + what + " of '" + r.tensor + "' " +
                      (body.size() < kContributionCountBytes
                           ? "is " + std::to_string(body.size()) +
                                 " bytes, shorter than its 8-byte count of entries"
                           : "declares " + std::to_string(declared) + " entries for a layer of " +
                                 std::to_string(n) + " elements"));
    };
    for (size_t c = 0; c < chunks; ++c) {
      if (ownerOf(i, c) != me) continue;
      const size_t len = r.chunking.size(c);
      for (uint32_t k_rank = 0; k_rank < w; ++k_rank) {
        if (k_rank == me) {
          auto own = r.payload(c);
          if (!own) return own.status();
          contributions[k_rank] = *own;
          entries[k_rank] = own_entries[i];
          continue;
        }
        if (chunks > 1 && !counted[k_rank]) {
          auto got = take(k_rank, keyOf(it.tensor, r, kPhaseCount, 0, k_rank));
          if (!got) return got.status();
          const std::span<const uint8_t> body = keep(std::move(got->payload));
          if (body.size() != kContributionCountBytes) {
            return dataLoss("rank " + std::to_string(k_rank) + "'s count of entries of '" +
                            r.tensor + "' is " + std::to_string(body.size()) + " bytes, not 8");
          }
          LW_RETURN_IF_ERROR(declare(k_rank, body, "count of entries"));
          counted[k_rank] = 1;
        }
        auto got =
            take(k_rank, keyOf(it.tensor, r, kPhaseContribute, static_cast<uint32_t>(c), k_rank));
        if (!got) return got.status();
        const std::span<const uint8_t> body = keep(std::move(got->payload));
        if (chunks > 1) {
          contributions[k_rank] = body;
          continue;
        }
        LW_RETURN_IF_ERROR(declare(k_rank, body, "contribution to chunk " + std::to_string(c)));
        contributions[k_rank] = body.subspan(kContributionCountBytes);
      }
      std::vector<uint8_t>& sel =
          sumBuffer(kernels::sparseMaxPayloadBytes(len, kernels::DType::kF32));
      auto size = kernels::reduceSelectChunk(r.codec, contributions, len, layer, select_sums_,
                                             select_scratch_, sel);
      if (!size) {
        return dataLoss("chunk " + std::to_string(c) + " of '" + r.tensor +
                        "': " + size.status().message());
      }
      const std::span<const uint8_t> result(sel.data(), *size);
      out[i][c].push_back(result);
      for (uint32_t k_rank = 0; k_rank < w; ++k_rank) {
        if (k_rank == me) continue;
        LW_RETURN_IF_ERROR(
            transport_.post(k_rank, FrameType::kData,
                            keyOf(it.tensor, r, kPhaseSelected, static_cast<uint32_t>(c), me),
                            static_cast<uint8_t>(r.codec.traits().id), result, deadline_));
      }
      if (r.on_chunk) LW_RETURN_IF_ERROR(r.on_chunk(c, out[i][c]));
    }
  }
  // The other owners' selections.
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    ExchangeRound& r = *it.r;
    for (size_t c = 0; c < r.chunking.count(); ++c) {
      const uint32_t owner = ownerOf(i, c);
      if (owner == me) continue;
      auto got = take(owner, keyOf(it.tensor, r, kPhaseSelected, static_cast<uint32_t>(c), owner));
      if (!got) return got.status();
      out[i][c].push_back(keep(std::move(got->payload)));
      if (r.on_chunk) LW_RETURN_IF_ERROR(r.on_chunk(c, out[i][c]));
    }
  }
  return out;
}

Status RingExchange::gatherPost(std::span<const Item> items, std::vector<Spans>& by_origin) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank(), next = (me + 1) % w;
  by_origin.assign(items.size(), {});
  for (size_t i = 0; i < items.size(); ++i) {
    const ExchangeRound& r = *items[i].r;
    const size_t chunks = r.chunking.count();
    by_origin[i].assign(chunks, std::vector<std::span<const uint8_t>>(w));
    for (size_t c = 0; c < chunks; ++c) {
      auto own = r.payload(c);  // compressed now: the previous chunk is on its way meanwhile
      if (!own) return own.status();
      by_origin[i][c][me] = *own;
      if (w > 1) {
        LW_RETURN_IF_ERROR(
            transport_.post(next, FrameType::kData,
                            keyOf(items[i].tensor, r, kPhaseGather, static_cast<uint32_t>(c), me),
                            static_cast<uint8_t>(r.codec.traits().id), *own, deadline_));
      }
    }
  }
  return Status::ok();
}

Status RingExchange::gatherReceive(std::span<const Item> items, std::vector<Spans>& by_origin) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  const uint32_t next = (me + 1) % w, prev = (me + w - 1) % w;
  // Hop h brings rank (me - h)'s payloads, every tensor's; each is forwarded unless next is where
  // it started.
  for (uint32_t h = 1; h < w; ++h) {
    const uint32_t origin = (me + w - h) % w;
    for (size_t i = 0; i < items.size(); ++i) {
      const ExchangeRound& r = *items[i].r;
      for (size_t c = 0; c < r.chunking.count(); ++c) {
        const FrameKey k =
            keyOf(items[i].tensor, r, kPhaseGather, static_cast<uint32_t>(c), origin);
        auto got = take(prev, k);
        if (!got) return got.status();
        by_origin[i][c][origin] = keep(std::move(got->payload));
        if (h + 1 < w) {
          LW_RETURN_IF_ERROR(transport_.post(next, FrameType::kData, k,
                                             static_cast<uint8_t>(r.codec.traits().id),
                                             by_origin[i][c][origin], deadline_));
        } else if (r.on_chunk) {  // the last hop: chunk c has every rank's payload
          LW_RETURN_IF_ERROR(r.on_chunk(c, by_origin[i][c]));
        }
      }
    }
  }
  return Status::ok();
}

}  // namespace lightwire::proxy::peer
