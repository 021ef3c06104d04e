// Vocabulary of the comm layer, shared by callers and backend implementers:
// which collective, which reduction, which algorithm, and the options structs
// every call and every communicator takes (timeouts are explicit, in
// milliseconds; sizes are in elements of the call's dtype unless a name says
// bytes).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/tensor/dtype.h"

namespace mt {

struct ClusterLayout;

// How contributions combine. `avg` is a sum divided by the group size once, at
// the end (integer dtypes divide with truncation toward zero).
enum class ReduceOp : uint8_t { sum, avg, max, min };

enum class Collective : uint8_t {
  all_reduce,
  all_gather,
  all_gatherv,
  reduce_scatter,
  reduce_scatterv,
  broadcast,
  all_to_all,
  all_to_allv,
  barrier,
  split,
  send,
  recv,
};

// The algorithm a collective runs. Which ones apply to which collective, and
// what each costs, is in docs/comm.md and next to each implementation.
enum class CommAlgorithm : uint8_t {
  automatic,         // AlgorithmPolicy picks by collective, size and backend
  ring,              // bandwidth-optimal, 2(n-1) steps for all-reduce
  halving_doubling,  // recursive halving / doubling, ~2 log2(n) steps
  shared_memory,     // node-shared memory window, pipelined in chunks
  native,            // the engine's own collective (MPI), polled with a deadline
  tree,              // binomial tree (broadcast)
  pairwise,          // n-1 pairwise exchanges (all-to-all)
  dissemination,     // ceil(log2 n) rounds of tokens (barrier)
  hierarchical,      // all-reduce on several nodes: reduce-scatter in each node,
                     // all-reduce across nodes, all-gather in each node
};

std::string_view collective_name(Collective c);
std::string_view reduce_op_name(ReduceOp op);
std::string_view algorithm_name(CommAlgorithm a);
// Parses "ring", "halving_doubling", ...; throws ConfigError naming the text.
CommAlgorithm parse_algorithm(std::string_view name);
ReduceOp parse_reduce_op(std::string_view name);

// Per-call options. Every blocking call has a deadline: `timeout` when set,
// else the communicator's CommOptions::timeout.
struct CollectiveOptions {
  std::optional<std::chrono::milliseconds> timeout;
  CommAlgorithm algorithm = CommAlgorithm::automatic;
  // Ranks must pass the same tag to a collective (checked by the handshake);
  // send/recv match on it. At most kMaxUserTag.
  uint32_t tag = 0;
  // Pre-collective agreement on (collective, dtype, count, root, op, tag,
  // algorithm); unset means CommOptions::handshake.
  std::optional<bool> handshake;
};

inline constexpr uint32_t kMaxUserTag = (1u << 20) - 1;

// An algorithm choice measured on this machine (comm/probe.h): for each
// probed collective, the algorithm that was fastest for each range of
// payload bytes, on a group of `size` ranks with (or without) a shared-memory
// window. Every rank of the probed communicator holds the same table (built
// from timings reduced to the slowest rank's), so every rank picks the same
// algorithm from it.
struct MeasuredChoice {
  struct Range {
    size_t max_bytes = 0;  // up to and including; the last range of a collective is open
    CommAlgorithm algorithm = CommAlgorithm::automatic;
  };
  struct Entry {
    Collective collective = Collective::all_reduce;  // all_reduce, all_gather or reduce_scatter
    std::vector<Range> ranges;                       // ascending max_bytes
  };
  int size = 0;
  bool shared_memory = false;
  std::vector<Entry> entries;
  std::string source;  // "probe on 2 ranks, 0.21 s" or "injected"

  // The measured algorithm for `c` on `bytes` payload bytes (the v-variants
  // and split use their collective's entry), or automatic when the table has
  // none for it.
  CommAlgorithm lookup(Collective c, size_t bytes) const;
  // "all_reduce: shared_memory up to 90 KiB, ring above; all_gather: ..."
  std::string describe() const;
};

// Which algorithm `automatic` picks. Defaults come from measurements on 2 and
// 4 ranks on one node (docs/comm.md); the choice depends only on values that
// every rank agrees on, so all ranks pick the same one.
struct AlgorithmPolicy {
  // Use the shared-memory algorithms whenever the backend offers a node-shared
  // window (all ranks on one node).
  bool prefer_shared_memory = true;
  // Without shared memory: messages up to this many bytes use halving-doubling
  // (fewer steps), larger ones ring (less per-step overhead, balanced links).
  size_t halving_doubling_max_bytes = 256 * 1024;
  // Without shared memory, use the engine's own collectives when it has them.
  bool prefer_native = false;
  // All-reduce on a communicator whose ranks sit on several nodes, each node
  // holding the same number (> 1) of them: the hierarchical algorithm (the
  // node groups come from Transport::node_of, i.e. the machine or
  // CommOptions::cluster). Checked by the communicator, not by choose().
  bool prefer_hierarchical = true;
  // A measured choice (comm/probe.h, `dist.algorithm_choice = measured`):
  // where it has an entry for the collective and was measured on a group of
  // this size with the same shared-memory window, and the algorithm it names
  // is available (shared memory, native), it decides; otherwise the static
  // rules below. Null: the static rules only.
  std::shared_ptr<const MeasuredChoice> measured;

  // The algorithm for `c` on `bytes` payload bytes (the full buffer for
  // all-reduce, the gathered size for all-gather/reduce-scatter) and `size`
  // ranks, given what the transport offers.
  CommAlgorithm choose(Collective c, size_t bytes, int size, bool has_shared_memory,
                       bool has_native) const;
};

// One finished call (collective or point to point), as the communicator's
// observer sees it: for timelines. Times are base/timer.h now_ns().
struct CallEvent {
  Collective kind = Collective::barrier;
  uint64_t seq = 0;  // collective sequence number (p2p: 0)
  size_t bytes = 0;  // payload bytes
  CommAlgorithm algorithm = CommAlgorithm::automatic;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  bool ok = true;  // false: it threw
};

// Options of one communicator (and, by default, of communicators split from it).
struct CommOptions {
  std::string name = "world";  // appears in every error message
  std::chrono::milliseconds timeout{300'000};
  bool handshake = true;
  // While a wait lasts longer than this, on_stall (when set) is called once per
  // wait with the watchdog report (who has not entered which collective).
  std::chrono::milliseconds stall_warning{60'000};
  std::function<void(const std::string&)> on_stall;
  // How long a wait spins before it yields its core, when each rank on this
  // node can have a core of its own (with more ranks than cores: 2 us).
  std::chrono::microseconds spin{200};
  AlgorithmPolicy policy;
  // Called after every call on the thread that ran it (the caller's, or the
  // progress thread for async calls); must be cheap and thread-safe.
  std::function<void(const CallEvent&)> on_call_done;
  // Node groups and emulated links (comm/cluster.h): the communicator wraps
  // its transport in a ClusterTransport over this layout, whose world must
  // be the communicator's ranks. Null: the machine's own grouping, links
  // unconstrained. Communicators split from it inherit the wrapped
  // transport, not this field.
  std::shared_ptr<const ClusterLayout> cluster;
};

// Cost of one call of an algorithm on one rank: latency-bound steps (rounds of
// messages or shared-memory synchronisations) and bytes moved to and from
// peers. Byte counts are exact for the given rank and counts; the byte
// counters of a communicator report the same numbers (tests check it).
struct CollectiveCost {
  int64_t steps = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};

}  // namespace mt
