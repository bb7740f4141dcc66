// The collective plans without sockets: every rank's plan is run on symbolic buffers, each
// element a tag (which element it is, which ranks' contributions it holds), through FIFO
// channels that move one item per step, as the transport does. A plan that reduces an element
// twice or never, sends a step its peer does not expect, deadlocks, or writes the wrong place
// fails here.
#include <doctest/doctest.h>

#include <cstdint>
#include <deque>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "plan.h"

namespace troupe::collectives {
namespace {

// An element's value: which element of the buffer it stands for (-1: never written) and the
// ranks whose contributions it holds.
struct Tag {
  int64_t index = -1;
  uint32_t ranks = 0;
  bool operator==(const Tag&) const = default;
};

std::ostream& operator<<(std::ostream& out, const Tag& tag) {
  return out << "element " << tag.index << " from ranks 0x" << std::hex << tag.ranks << std::dec;
}

using Buffer = std::vector<Tag>;

struct RankState {
  CollectivePlan plan;
  Buffer input, output, workspace;
  std::map<int, Buffer> scratch;  // by peer
  std::vector<bool> events;
  std::map<int, size_t> nextSend, nextRecv;  // by peer: index into the per-peer lists
  std::map<int, std::vector<const PlanSend*>> sends;
  std::map<int, std::vector<const PlanRecv*>> recvs;
  std::vector<int> outputWrites;  // how many receives wrote each output element
};

Buffer& region(RankState& state, Region which, int peer) {
  switch (which) {
    case Region::kInput: return state.input;
    case Region::kOutput: return state.output;
    case Region::kWorkspace: return state.workspace;
    case Region::kScratch: return state.scratch[peer];
  }
  return state.input;
}

struct Case {
  OpKind kind;
  int world;
  size_t count;
  bool oneHop;
  size_t chunk;
  int root = 0;
};

std::string describe(const Case& c) {
  return fmt::format("{} world {} count {} {} chunk {} root {}", opKindName(c.kind), c.world, c.count,
                     c.oneHop ? "one hop" : "ring", c.chunk, c.root);
}

uint32_t allRanks(int world) { return (uint32_t{1} << world) - 1; }

// Runs every rank's plan to the end and returns the ranks' final states. Fails the test case on
// any mismatch between what a rank sends and what its peer expects, or on a deadlock.
std::vector<RankState> run(const Case& c) {
  const int n = c.world;
  std::vector<RankState> ranks(static_cast<size_t>(n));
  for (int me = 0; me < n; ++me) {
    RankState& s = ranks[me];
    PlanShape shape;
    shape.kind = c.kind;
    shape.worldSize = n;
    shape.rank = me;
    shape.count = c.count;
    shape.op = ReduceOp::kAvg;
    shape.root = c.root;
    shape.oneHop = c.oneHop;
    shape.chunkElements = c.chunk;
    planCollective(shape, s.plan);

    const Shard mine = shardOf(c.count, n, me);
    const size_t inputSize = c.kind == OpKind::kAllgather ? mine.size() : c.count;
    const size_t inputBegin = c.kind == OpKind::kAllgather ? mine.begin : 0;
    for (size_t i = 0; i < inputSize; ++i) {
      s.input.push_back(Tag{static_cast<int64_t>(inputBegin + i), uint32_t{1} << me});
    }
    const size_t outputSize = c.kind == OpKind::kReduceScatter ? mine.size() : c.count;
    s.output.assign(outputSize, Tag{});
    if (c.kind == OpKind::kBroadcast && me == c.root) s.output = s.input;  // one buffer
    s.outputWrites.assign(outputSize, 0);
    s.workspace.assign(s.plan.workspaceElements, Tag{});
    s.events.assign(static_cast<size_t>(s.plan.events), false);
    for (int p = 0; p < n; ++p) {
      if (p != me) s.scratch[p].assign(c.count, Tag{});
    }

    if (s.plan.copy) {
      const PlanCopy& copy = *s.plan.copy;
      REQUIRE(copy.fromBegin + copy.count <= s.input.size());
      REQUIRE(copy.toBegin + copy.count <= s.output.size());
      for (size_t i = 0; i < copy.count; ++i) s.output[copy.toBegin + i] = s.input[copy.fromBegin + i];
    }
    for (const PlanSend& send : s.plan.sends) {
      REQUIRE(send.peer != me);
      REQUIRE(send.count > 0);
      REQUIRE(send.count <= (c.oneHop ? c.count : c.chunk));
      REQUIRE(send.waitEvent < s.plan.events);
      s.sends[send.peer].push_back(&send);
    }
    std::vector<int> setters(static_cast<size_t>(s.plan.events), 0);
    for (const PlanRecv& recv : s.plan.recvs) {
      REQUIRE(recv.peer != me);
      REQUIRE(recv.count > 0);
      REQUIRE(recv.count <= (c.oneHop ? c.count : c.chunk));
      if (recv.event >= 0) {
        REQUIRE(recv.event < s.plan.events);
        ++setters[recv.event];
      }
      s.recvs[recv.peer].push_back(&recv);
    }
    for (int setBy : setters) CHECK(setBy == 1);  // each event set by exactly one receive
  }

  // Links: a rank sends a header to p exactly when p expects one from it.
  auto linked = [&](int from, int to, bool send) {
    for (const PlanLink& link : ranks[from].plan.links) {
      if (link.peer == to && (send ? link.send : link.recv)) return true;
    }
    return false;
  };
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      INFO("link ", a, " -> ", b);
      CHECK(linked(a, b, true) == linked(b, a, false));
      if (!ranks[a].sends[b].empty()) CHECK(linked(a, b, true));
      if (!ranks[b].recvs[a].empty()) CHECK(linked(b, a, false));
    }
  }

  // The transport's rules: per peer, sends in order, each once its event is set; receives in
  // order, each taking the next message on that channel.
  std::map<std::pair<int, int>, std::deque<Buffer>> channels;
  for (bool progress = true; progress;) {
    progress = false;
    for (int me = 0; me < n; ++me) {
      RankState& s = ranks[me];
      for (auto& [peer, list] : s.sends) {
        size_t& next = s.nextSend[peer];
        while (next < list.size() && (list[next]->waitEvent < 0 || s.events[list[next]->waitEvent])) {
          const PlanSend& send = *list[next++];
          const Buffer& from = region(s, send.from, peer);
          REQUIRE(send.begin + send.count <= from.size());
          channels[{me, peer}].emplace_back(from.begin() + static_cast<ptrdiff_t>(send.begin),
                                            from.begin() + static_cast<ptrdiff_t>(send.begin + send.count));
          progress = true;
        }
      }
      for (auto& [peer, list] : s.recvs) {
        size_t& next = s.nextRecv[peer];
        std::deque<Buffer>& channel = channels[{peer, me}];
        while (next < list.size() && !channel.empty()) {
          const PlanRecv& recv = *list[next++];
          Buffer message = std::move(channel.front());
          channel.pop_front();
          INFO("rank ", me, " from ", peer);
          REQUIRE(message.size() == recv.count);  // the sender's step matches the receiver's
          Buffer& into = region(s, recv.into, peer);
          REQUIRE(recv.begin + recv.count <= into.size());
          for (size_t i = 0; i < recv.count; ++i) {
            into[recv.begin + i] = message[i];
            if (recv.into == Region::kOutput) ++s.outputWrites[recv.begin + i];
          }
          if (recv.reduce) {
            Buffer& out = region(s, recv.reduceInto, peer);
            REQUIRE(recv.reduceBegin + recv.count <= out.size());
            REQUIRE(recv.localBegin + recv.count <= s.input.size());
            for (size_t i = 0; i < recv.count; ++i) {
              const Tag local = s.input[recv.localBegin + i];
              const Tag arrived = message[i];
              REQUIRE(arrived.index == local.index);  // the same element from both sides
              REQUIRE((arrived.ranks & local.ranks) == 0);  // no contribution counted twice
              out[recv.reduceBegin + i] = Tag{local.index, local.ranks | arrived.ranks};
            }
            // An average divides once, on the step that completes the sum.
            const bool complete = (out[recv.reduceBegin].ranks == allRanks(n));
            CHECK(recv.divisor == (complete ? n : 1));
          }
          if (recv.event >= 0) {
            REQUIRE_FALSE(s.events[recv.event]);
            s.events[recv.event] = true;
          }
          progress = true;
        }
      }
    }
  }

  // Nothing left: every step ran and every message was taken (no deadlock, no extra step).
  for (int me = 0; me < n; ++me) {
    RankState& s = ranks[me];
    for (auto& [peer, list] : s.sends) CHECK(s.nextSend[peer] == list.size());
    for (auto& [peer, list] : s.recvs) CHECK(s.nextRecv[peer] == list.size());
  }
  for (auto& [link, channel] : channels) CHECK(channel.empty());

  // One hop reductions: output = every rank's part, in rank order.
  for (int me = 0; me < n; ++me) {
    RankState& s = ranks[me];
    if (!s.plan.finalReduce) continue;
    const PlanFinalReduce& reduce = *s.plan.finalReduce;
    CHECK(reduce.divisor == n);
    REQUIRE(reduce.count <= s.output.size());
    for (size_t i = 0; i < reduce.count; ++i) {
      Tag sum = s.input[reduce.selfBegin + i];
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        const Tag part = s.scratch[p][i];
        REQUIRE(part.index == sum.index);
        REQUIRE((part.ranks & sum.ranks) == 0);
        sum.ranks |= part.ranks;
      }
      s.output[i] = sum;
    }
  }
  return ranks;
}

// What each rank's output must hold at the end.
void checkResult(const Case& c, const std::vector<RankState>& ranks) {
  const int n = c.world;
  for (int me = 0; me < n; ++me) {
    const RankState& s = ranks[me];
    const Shard mine = shardOf(c.count, n, me);
    INFO("rank ", me);
    for (size_t i = 0; i < s.output.size(); ++i) {
      Tag want{static_cast<int64_t>(i), allRanks(n)};
      switch (c.kind) {
        case OpKind::kAllreduce: break;
        case OpKind::kReduceScatter: want.index = static_cast<int64_t>(mine.begin + i); break;
        case OpKind::kAllgather:
          for (int r = 0; r < n; ++r) {
            const Shard theirs = shardOf(c.count, n, r);
            if (i >= theirs.begin && i < theirs.end) want.ranks = uint32_t{1} << r;
          }
          break;
        case OpKind::kBroadcast: want.ranks = uint32_t{1} << c.root; break;
        default: break;
      }
      INFO("element ", i);
      REQUIRE(s.output[i] == want);
      CHECK(s.outputWrites[i] <= 1);  // no element delivered twice
    }
  }
}

std::vector<size_t> countsFor(int world) {
  return {0, 1, static_cast<size_t>(world - 1), static_cast<size_t>(world), static_cast<size_t>(world + 1),
          7, 64, 1001};
}

TEST_CASE("every plan delivers each element once, reduced once from every rank") {
  for (OpKind kind : {OpKind::kAllreduce, OpKind::kReduceScatter, OpKind::kAllgather, OpKind::kBroadcast}) {
    for (int world = 1; world <= 7; ++world) {
      for (size_t count : countsFor(world)) {
        for (bool oneHop : {true, false}) {
          for (size_t chunk : {size_t{1}, size_t{3}, size_t{64}, size_t{4096}}) {
            for (int root = 0; root < (kind == OpKind::kBroadcast ? world : 1); ++root) {
              const Case c{kind, world, count, oneHop, chunk, root};
              INFO(describe(c));
              checkResult(c, run(c));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("ring chunks cut each shard into contiguous pieces of at most chunkElements, in order") {
  for (int world = 2; world <= 5; ++world) {
    for (size_t count : {size_t{1}, size_t{3}, size_t{10}, size_t{1001}}) {
      for (size_t chunk : {size_t{1}, size_t{4}, size_t{100}}) {
        for (int me = 0; me < world; ++me) {
          INFO("world ", world, " count ", count, " chunk ", chunk, " rank ", me);
          CollectivePlan plan;
          PlanShape shape{OpKind::kAllreduce, world, me, count, ReduceOp::kSum, -1, -1, false, chunk};
          planCollective(shape, plan);
          // Reduce-scatter then all-gather: each sends 2 (n - 1) segments to the right, every
          // shard but one in each half, each cut from its begin to its end.
          size_t expected = 0;
          for (int s = 0; s < 2 * (world - 1); ++s) {
            const int segment = ((me - (s < world - 1 ? s + 1 : s - (world - 1))) % world + world) % world;
            const Shard shard = shardOf(count, world, segment);
            for (size_t at = shard.begin; at < shard.end; at += chunk) {
              REQUIRE(expected < plan.sends.size());
              const PlanSend& send = plan.sends[expected++];
              CHECK(send.peer == (me + 1) % world);
              CHECK(send.begin == at);
              CHECK(send.count == std::min(chunk, shard.end - at));
            }
          }
          CHECK(expected == plan.sends.size());
          for (const PlanRecv& recv : plan.recvs) CHECK(recv.peer == (me + world - 1) % world);
        }
      }
    }
  }
}

TEST_CASE("p2p and barrier plans pair each rank's send with its peer's receive") {
  CollectivePlan a, b;
  planCollective(PlanShape{OpKind::kSendRecv, 3, 0, 5, ReduceOp::kSum, 1, 2, false, 1}, a);
  REQUIRE(a.sends.size() == 1);
  REQUIRE(a.recvs.size() == 1);
  CHECK(a.sends[0].peer == 1);
  CHECK(a.sends[0].count == 5);
  CHECK(a.recvs[0].peer == 2);
  CHECK(a.recvs[0].into == Region::kOutput);

  planCollective(PlanShape{OpKind::kSend, 2, 0, 0, ReduceOp::kSum, 1, -1, true, 1}, a);
  planCollective(PlanShape{OpKind::kRecv, 2, 1, 0, ReduceOp::kSum, 0, -1, true, 1}, b);
  CHECK(a.sends.empty());  // nothing to send, but the header still goes
  REQUIRE(a.links.size() == 1);
  CHECK((a.links[0].peer == 1 && a.links[0].send && !a.links[0].recv));
  REQUIRE(b.links.size() == 1);
  CHECK((b.links[0].peer == 0 && !b.links[0].send && b.links[0].recv));

  planCollective(PlanShape{OpKind::kBarrier, 4, 2, 0, ReduceOp::kSum, -1, -1, true, 1}, a);
  CHECK(a.links.size() == 3);
  for (const PlanLink& link : a.links) CHECK((link.peer != 2 && link.send && link.recv));
  CHECK(a.sends.empty());
  CHECK(a.recvs.empty());
}

}  // namespace
}  // namespace troupe::collectives
