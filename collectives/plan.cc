#include "plan.h"

#include <algorithm>

namespace troupe::collectives {

const char* opKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kSendRecv: return "sendrecv";
  }
  return "unknown";
}

void CollectivePlan::clear() {
  copy.reset();
  links.clear();
  sends.clear();
  recvs.clear();
  events = 0;
  workspaceElements = 0;
  finalReduce.reset();
}

namespace {

// One plan under construction, with the shape's ring arithmetic.
class Planner {
 public:
  Planner(const PlanShape& shape, CollectivePlan& plan)
      : s_(shape), plan_(plan), n_(shape.worldSize), me_(shape.rank) {}

  void plan() {
    const Shard mine = shardOf(s_.count, n_, me_);
    switch (s_.kind) {
      case OpKind::kAllreduce:
        if (n_ == 1) {
          plan_.copy = PlanCopy{0, 0, s_.count};
        } else if (s_.oneHop) {
          oneHopAllreduce();
        } else {
          ringAllreduce();
        }
        break;
      case OpKind::kReduceScatter:
        if (n_ == 1) {
          plan_.copy = PlanCopy{0, 0, s_.count};
        } else if (s_.oneHop) {
          oneHopReduceScatter();
        } else {
          plan_.workspaceElements = s_.count;
          ringReduceScatter(Region::kWorkspace, 0);
        }
        break;
      case OpKind::kAllgather:
        plan_.copy = PlanCopy{0, mine.begin, mine.size()};
        if (n_ == 1) break;
        if (s_.oneHop) {
          oneHopAllgather();
        } else {
          ringAllgather(/*prevBase=*/-1);
        }
        break;
      case OpKind::kBroadcast:
        if (n_ == 1) break;
        if (s_.oneHop) {
          oneHopBroadcast();
        } else {
          chainBroadcast();
        }
        break;
      case OpKind::kBarrier:
        for (int p = 0; p < n_; ++p) {
          if (p != me_) link(p, true, true);
        }
        break;
      case OpKind::kSend:
        link(s_.root, true, false);
        send(s_.root, Region::kInput, 0, s_.count, -1);
        break;
      case OpKind::kRecv:
        link(s_.root, false, true);
        recv(PlanRecv{s_.root, Region::kOutput, 0, s_.count});
        break;
      case OpKind::kSendRecv:
        link(s_.root, true, false);
        send(s_.root, Region::kInput, 0, s_.count, -1);
        link(s_.from, false, true);
        recv(PlanRecv{s_.from, Region::kOutput, 0, s_.count});
        break;
    }
  }

 private:
  int mod(int x) const { return ((x % n_) + n_) % n_; }
  int divisor() const { return s_.op == ReduceOp::kAvg ? n_ : 1; }
  int32_t newEvent() { return plan_.events++; }

  void link(int peer, bool send, bool recv) { plan_.links.push_back(PlanLink{peer, send, recv}); }

  void send(int peer, Region from, size_t begin, size_t count, int32_t waitEvent) {
    if (count == 0) return;
    plan_.sends.push_back(PlanSend{peer, from, begin, count, waitEvent});
  }

  void recv(const PlanRecv& item) {
    if (item.count == 0) return;
    plan_.recvs.push_back(item);
  }

  // One hop: every rank sends its whole input to every rank and reduces all of them at the end.
  void oneHopAllreduce() {
    for (int p = 0; p < n_; ++p) {
      if (p == me_) continue;
      link(p, true, true);
      send(p, Region::kInput, 0, s_.count, -1);
      recv(PlanRecv{p, Region::kScratch, 0, s_.count});
    }
    plan_.finalReduce = PlanFinalReduce{0, s_.count, divisor()};
  }

  void oneHopReduceScatter() {
    const Shard mine = shardOf(s_.count, n_, me_);
    for (int p = 0; p < n_; ++p) {
      if (p == me_) continue;
      const Shard theirs = shardOf(s_.count, n_, p);
      link(p, true, true);
      send(p, Region::kInput, theirs.begin, theirs.size(), -1);
      recv(PlanRecv{p, Region::kScratch, 0, mine.size()});
    }
    plan_.finalReduce = PlanFinalReduce{mine.begin, mine.size(), divisor()};
  }

  void oneHopAllgather() {
    const Shard mine = shardOf(s_.count, n_, me_);
    for (int p = 0; p < n_; ++p) {
      if (p == me_) continue;
      const Shard theirs = shardOf(s_.count, n_, p);
      link(p, true, true);
      send(p, Region::kOutput, mine.begin, mine.size(), -1);
      recv(PlanRecv{p, Region::kOutput, theirs.begin, theirs.size()});
    }
  }

  void oneHopBroadcast() {
    if (me_ == s_.root) {
      for (int p = 0; p < n_; ++p) {
        if (p == me_) continue;
        link(p, true, false);
        send(p, Region::kOutput, 0, s_.count, -1);
      }
    } else {
      link(s_.root, false, true);
      recv(PlanRecv{s_.root, Region::kOutput, 0, s_.count});
    }
  }

  // Ring reduce-scatter steps of an all-reduce or reduce-scatter. Step s sends segment
  // (me - s - 1) to the right and receives segment (me - s - 2) from the left, reducing it with
  // this rank's input; after n - 1 steps segment `me` is complete here. A chunk of step s + 1
  // is sent as soon as the same chunk of step s has been received and reduced.
  // `partial` holds the partial sums (sent on); segment me's result goes to kOutput at
  // `finalBegin`. Returns the event base of the last step's receives.
  int32_t ringReduceScatter(Region partial, size_t finalBegin) {
    const size_t chunk = s_.chunkElements;
    const int right = mod(me_ + 1), left = mod(me_ - 1);
    link(right, true, false);
    link(left, false, true);
    int32_t prevBase = -1;
    for (int s = 0; s <= n_ - 2; ++s) {
      const Shard out = shardOf(s_.count, n_, mod(me_ - s - 1));
      const Region source = s == 0 ? Region::kInput : partial;
      for (size_t k = 0, at = out.begin; at < out.end; ++k, at += chunk) {
        send(right, source, at, std::min(chunk, out.end - at),
             s == 0 ? -1 : prevBase + static_cast<int32_t>(k));
      }
      const Shard in = shardOf(s_.count, n_, mod(me_ - s - 2));
      const bool last = s == n_ - 2;
      const int32_t base = plan_.events;
      for (size_t at = in.begin; at < in.end; at += chunk) {
        PlanRecv item{left, Region::kScratch, 0, std::min(chunk, in.end - at), newEvent()};
        item.reduce = true;
        item.reduceInto = last ? Region::kOutput : partial;
        item.reduceBegin = last ? finalBegin + (at - in.begin) : at;
        item.localBegin = at;
        item.divisor = last ? divisor() : 1;
        recv(item);
      }
      prevBase = base;
    }
    return prevBase;
  }

  // Reduce-scatter into the output itself (segment me lands in place), then all-gather from it.
  void ringAllreduce() {
    const Shard mine = shardOf(s_.count, n_, me_);
    ringAllgather(ringReduceScatter(Region::kOutput, mine.begin));
  }

  // Ring all-gather over the output: step t sends segment (me - t) and receives (me - t - 1)
  // straight into place; a chunk is forwarded once it arrived. `prevBase` is the event base that
  // guards segment me's chunks (its last reduce-scatter step), or -1 when it is ready.
  void ringAllgather(int32_t prevBase) {
    const size_t chunk = s_.chunkElements;
    const int right = mod(me_ + 1), left = mod(me_ - 1);
    link(right, true, false);
    link(left, false, true);
    for (int t = 0; t <= n_ - 2; ++t) {
      const Shard out = shardOf(s_.count, n_, mod(me_ - t));
      for (size_t k = 0, at = out.begin; at < out.end; ++k, at += chunk) {
        send(right, Region::kOutput, at, std::min(chunk, out.end - at),
             prevBase < 0 ? -1 : prevBase + static_cast<int32_t>(k));
      }
      const Shard in = shardOf(s_.count, n_, mod(me_ - t - 1));
      const int32_t base = plan_.events;
      for (size_t at = in.begin; at < in.end; at += chunk) {
        recv(PlanRecv{left, Region::kOutput, at, std::min(chunk, in.end - at), newEvent()});
      }
      prevBase = base;
    }
  }

  // Pipelined chain from the root: each rank receives chunk k from its predecessor and forwards
  // it to its successor as soon as it arrived.
  void chainBroadcast() {
    const size_t chunk = s_.chunkElements;
    const int position = mod(me_ - s_.root);
    const int32_t base = plan_.events;
    if (position > 0) {
      link(mod(me_ - 1), false, true);
      for (size_t at = 0; at < s_.count; at += chunk) {
        recv(PlanRecv{mod(me_ - 1), Region::kOutput, at, std::min(chunk, s_.count - at), newEvent()});
      }
    }
    if (position < n_ - 1) {
      link(mod(me_ + 1), true, false);
      for (size_t k = 0, at = 0; at < s_.count; ++k, at += chunk) {
        send(mod(me_ + 1), Region::kOutput, at, std::min(chunk, s_.count - at),
             position == 0 ? -1 : base + static_cast<int32_t>(k));
      }
    }
  }

  const PlanShape& s_;
  CollectivePlan& plan_;
  const int n_;
  const int me_;
};

}  // namespace

void planCollective(const PlanShape& shape, CollectivePlan& plan) {
  plan.clear();
  Planner(shape, plan).plan();
}

}  // namespace troupe::collectives
