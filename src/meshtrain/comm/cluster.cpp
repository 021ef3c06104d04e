#include "meshtrain/comm/cluster.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "meshtrain/base/error.h"

namespace mt {

// ---- layout -------------------------------------------------------------------

std::string LinkSpec::describe() const {
  if (!constrained()) return "unconstrained";
  std::string bw = "unlimited bandwidth";
  if (bandwidth_bytes_s > 0) {
    const double bits = bandwidth_bytes_s * 8;
    bw = bits >= 1e9 ? fmt::format("{:g} Gbit/s", bits / 1e9)
                     : fmt::format("{:g} Mbit/s", bits / 1e6);
  }
  return fmt::format("{}, {:g} ms", bw, latency_s * 1e3);
}

std::string_view link_sharing_name(LinkSharing s) {
  return s == LinkSharing::node_pair ? "node_pair" : "rank_pair";
}

std::string_view link_kind_name(LinkKind k) {
  switch (k) {
    case LinkKind::self:
      return "self";
    case LinkKind::intra_node:
      return "intra_node";
    case LinkKind::inter_node:
      return "inter_node";
    case LinkKind::inter_site:
      return "inter_site";
  }
  return "?";
}

ClusterLayout ClusterLayout::by_node_size(int world, int node_size) {
  if (world < 1 || node_size < 1) {
    throw ConfigError(fmt::format("dist.node_size: expected an integer >= 1, got {} (world {})",
                                  node_size, world));
  }
  ClusterLayout l;
  l.source = fmt::format("dist.node_size = {}", node_size);
  for (int r = 0; r < world; ++r) l.node_of.push_back(r / node_size);
  const int nodes = (world + node_size - 1) / node_size;
  for (int k = 0; k < nodes; ++k) {
    l.node_names.push_back(fmt::format("node{}", k));
    l.site_of_node.push_back(0);
  }
  return l;
}

LinkKind ClusterLayout::kind(int a, int b) const {
  if (a == b) return LinkKind::self;
  const int na = node_of[static_cast<size_t>(a)];
  const int nb = node_of[static_cast<size_t>(b)];
  if (na == nb) return LinkKind::intra_node;
  return site_of_node[static_cast<size_t>(na)] == site_of_node[static_cast<size_t>(nb)]
             ? LinkKind::inter_node
             : LinkKind::inter_site;
}

const LinkSpec& ClusterLayout::link(int a, int b) const {
  static const LinkSpec none;
  switch (kind(a, b)) {
    case LinkKind::self:
      return none;
    case LinkKind::intra_node:
      return intra_node;
    default:
      break;
  }
  const int na = node_of[static_cast<size_t>(a)];
  const int nb = node_of[static_cast<size_t>(b)];
  if (auto it = node_pairs.find({std::min(na, nb), std::max(na, nb)}); it != node_pairs.end()) {
    return it->second;
  }
  return kind(a, b) == LinkKind::inter_node ? inter_node : inter_site;
}

bool ClusterLayout::emulates() const {
  if (nodes() > 0 && world() > nodes() && intra_node.constrained()) return true;
  if (nodes() > 1 && (inter_node.constrained() || inter_site.constrained())) {
    // inter_site matters only with several sites, inter_node only with two
    // nodes on one site; a constrained kind that no pair uses changes nothing.
    for (int a = 0; a < world(); ++a) {
      for (int b = 0; b < world(); ++b) {
        if (link(a, b).constrained()) return true;
      }
    }
  }
  for (const auto& [pair, spec] : node_pairs) {
    if (spec.constrained()) return true;
  }
  return false;
}

std::string ClusterLayout::describe() const {
  std::vector<int> per(static_cast<size_t>(nodes()), 0);
  for (int n : node_of) ++per[static_cast<size_t>(n)];
  std::string s = fmt::format("{} rank{} on {} node{} ({})", world(), world() == 1 ? "" : "s",
                              nodes(), nodes() == 1 ? "" : "s", fmt::join(per, " + "));
  const int sites =
      site_of_node.empty() ? 1 : *std::max_element(site_of_node.begin(), site_of_node.end()) + 1;
  if (sites > 1) s += fmt::format(" at {} sites", sites);
  if (emulates()) {
    s += fmt::format("; emulated links: intra-node {}, inter-node {}", intra_node.describe(),
                     inter_node.describe());
    if (sites > 1) s += fmt::format(", inter-site {}", inter_site.describe());
    if (!node_pairs.empty()) s += fmt::format(", {} node pair(s) of their own", node_pairs.size());
    s += sharing == LinkSharing::node_pair
             ? "; one link per node pair and direction, shared by the nodes' ranks"
             : "; one link per rank pair and direction";
  } else {
    s += "; links unconstrained";
  }
  return s;
}

void ClusterLayout::validate() const {
  const int n = nodes();
  if (static_cast<int>(site_of_node.size()) != n) {
    throw ConfigError(
        fmt::format("cluster {}: {} nodes but {} site entries", source, n, site_of_node.size()));
  }
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (size_t r = 0; r < node_of.size(); ++r) {
    const int k = node_of[r];
    if (k < 0 || k >= n) {
      throw ConfigError(fmt::format("cluster {}: rank {} is on node {}, expected a node in [0, {})",
                                    source, r, k, n));
    }
    seen[static_cast<size_t>(k)] = 1;
  }
  for (int k = 0; k < n; ++k) {
    if (!seen[static_cast<size_t>(k)]) {
      throw ConfigError(fmt::format("cluster {}: node {} ('{}') holds no rank of the {}-rank job",
                                    source, k, node_names[static_cast<size_t>(k)], world()));
    }
  }
}

// ---- the transport ----------------------------------------------------------------

namespace {

using Clock = CommClock;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

// One message waiting for its emulated arrival. Handed to the real transport
// (in FIFO order per destination) once that time has come.
struct DelayedSend {
  Transport* inner = nullptr;
  int peer = 0;  // rank in `inner`
  uint32_t tag = 0;
  const void* buf = nullptr;
  size_t bytes = 0;
  Clock::time_point due;
  std::unique_ptr<TransportRequest> req;  // set when posted
  bool cancelled = false;
};

// When each directed node pair's link is free again (steady_clock
// nanoseconds, CLOCK_MONOTONIC: the same in every process of a host), in a
// file under /dev/shm that every rank maps.
class NodeLinkTable {
 public:
  NodeLinkTable(const std::string& path, int nodes, bool owner)
      : path_(path), nodes_(nodes), owner_(owner) {
    bytes_ = sizeof(std::atomic<int64_t>) * static_cast<size_t>(nodes) * static_cast<size_t>(nodes);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) {
      throw CommError(fmt::format("link emulation: cannot open the shared link table {}: {}", path,
                                  std::strerror(errno)));
    }
    if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
      const int err = errno;
      ::close(fd);
      throw CommError(fmt::format("link emulation: cannot size the shared link table {}: {}", path,
                                  std::strerror(err)));
    }
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      throw CommError(fmt::format("link emulation: cannot map the shared link table {}: {}", path,
                                  std::strerror(errno)));
    }
    free_ = static_cast<std::atomic<int64_t>*>(p);  // zero-filled by ftruncate
  }
  ~NodeLinkTable() {
    ::munmap(free_, bytes_);
    if (owner_) ::unlink(path_.c_str());  // the others keep their mappings
  }
  NodeLinkTable(const NodeLinkTable&) = delete;
  NodeLinkTable& operator=(const NodeLinkTable&) = delete;

  // Reserves the link a -> b for `duration` from max(now, free); returns the start.
  int64_t reserve(int a, int b, int64_t now, int64_t duration) {
    std::atomic<int64_t>& free = free_[static_cast<size_t>(a * nodes_ + b)];
    int64_t seen = free.load(std::memory_order_relaxed);
    int64_t start;
    do {
      start = std::max(now, seen);
    } while (!free.compare_exchange_weak(seen, start + duration, std::memory_order_acq_rel));
    return start;
  }

 private:
  std::string path_;
  int nodes_;
  bool owner_;
  size_t bytes_ = 0;
  std::atomic<int64_t>* free_ = nullptr;
};

class LinkQueues {
 public:
  LinkQueues(int world, std::shared_ptr<NodeLinkTable> shared)
      : free_at_(static_cast<size_t>(world)),
        queue_(static_cast<size_t>(world)),
        shared_(std::move(shared)) {}

  // The message enters the link when the link is free (a link direction
  // carries one message at a time at its full bandwidth, in the order sent),
  // leaves it bytes / bandwidth later and arrives a latency after that. The
  // link is the rank pair's, or (node_pair sharing, between two nodes) the
  // node pair's, which every rank of the sending node reserves in the shared
  // table; either way later messages to one destination never arrive first.
  void enqueue(int dst, const std::shared_ptr<DelayedSend>& s, const LinkSpec& link, int src_node,
               int dst_node) {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    const Clock::duration transfer = seconds(link.transfer_s(s->bytes));
    Clock::time_point& free = free_at_[static_cast<size_t>(dst)];
    Clock::time_point start = std::max(now, free);
    if (shared_ && src_node != dst_node) {
      start = Clock::time_point(Clock::duration(shared_->reserve(
          src_node, dst_node, start.time_since_epoch().count(), transfer.count())));
    }
    free = start + transfer;
    s->due = free + seconds(link.latency_s);
    queue_[static_cast<size_t>(dst)].push_back(s);
  }

  // Posts, in order, every queued message to `dst` whose time has come.
  void flush(int dst) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = queue_[static_cast<size_t>(dst)];
    const Clock::time_point now = Clock::now();
    while (!q.empty()) {
      DelayedSend& s = *q.front();
      if (!s.cancelled) {
        if (now < s.due) break;
        s.req = s.inner->isend(s.peer, s.tag, s.buf, s.bytes);
      }
      q.pop_front();
    }
  }

  void cancel(DelayedSend& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.req) s.cancelled = true;
  }

 private:
  std::mutex mu_;
  std::vector<Clock::time_point> free_at_;
  std::vector<std::deque<std::shared_ptr<DelayedSend>>> queue_;
  std::shared_ptr<NodeLinkTable> shared_;
};

namespace {

class DelayedSendRequest final : public TransportRequest {
 public:
  DelayedSendRequest(std::shared_ptr<LinkQueues> links, int dst, std::shared_ptr<DelayedSend> s)
      : links_(std::move(links)), dst_(dst), s_(std::move(s)) {}
  ~DelayedSendRequest() override { links_->cancel(*s_); }

  bool test() override {
    if (!s_->req) {
      links_->flush(dst_);
      if (!s_->req) return false;
    }
    return s_->req->test();
  }

 private:
  std::shared_ptr<LinkQueues> links_;
  int dst_;
  std::shared_ptr<DelayedSend> s_;
};

class ClusterTransport final : public Transport {
 public:
  ClusterTransport(std::shared_ptr<Transport> inner, std::shared_ptr<const ClusterLayout> layout,
                   std::vector<int> world, std::shared_ptr<LinkQueues> links)
      : inner_(std::move(inner)),
        layout_(std::move(layout)),
        world_(std::move(world)),
        links_(std::move(links)),
        emulate_(layout_->emulates()) {
    std::vector<int> nodes;
    for (int w : world_) nodes.push_back(layout_->node_of[static_cast<size_t>(w)]);
    one_node_ = std::all_of(nodes.begin(), nodes.end(), [&](int k) { return k == nodes[0]; });
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  int ranks_on_node() const override { return inner_->ranks_on_node(); }
  uint32_t max_tag() const override { return inner_->max_tag(); }

  std::vector<int> node_of() const override {
    // Renumbered in order of first appearance, as the machine's grouping is.
    std::vector<int> out;
    std::map<int, int> index;
    for (int w : world_) {
      const int k = layout_->node_of[static_cast<size_t>(w)];
      auto [it, added] = index.try_emplace(k, static_cast<int>(index.size()));
      out.push_back(it->second);
    }
    return out;
  }

  std::unique_ptr<TransportRequest> isend(int peer, uint32_t tag, const void* buf,
                                          size_t bytes) override {
    const int dst = world_[static_cast<size_t>(peer)];
    const LinkSpec& link = layout_->link(world_[static_cast<size_t>(rank())], dst);
    // A pair's link never changes, so an unconstrained one never has queued
    // messages that a direct send could overtake.
    if (!link.constrained()) return inner_->isend(peer, tag, buf, bytes);
    auto s = std::make_shared<DelayedSend>();
    s->inner = inner_.get();
    s->peer = peer;
    s->tag = tag;
    s->buf = buf;
    s->bytes = bytes;
    links_->enqueue(dst, s, link,
                    layout_->node_of[static_cast<size_t>(world_[static_cast<size_t>(rank())])],
                    layout_->node_of[static_cast<size_t>(dst)]);
    return std::make_unique<DelayedSendRequest>(links_, dst, std::move(s));
  }

  std::unique_ptr<TransportRequest> irecv(int peer, uint32_t tag, void* buf,
                                          size_t bytes) override {
    return inner_->irecv(peer, tag, buf, bytes);
  }

  std::optional<std::string> lost_peer(std::span<const int> peers) override {
    return inner_->lost_peer(peers);
  }

  std::shared_ptr<Transport> split(int group, const std::vector<int>& members, uint64_t split_id,
                                   Deadline deadline) override {
    std::shared_ptr<Transport> t = inner_->split(group, members, split_id, deadline);
    if (!t) return nullptr;
    std::vector<int> world;
    for (int m : members) world.push_back(world_[static_cast<size_t>(m)]);
    return std::make_shared<ClusterTransport>(std::move(t), layout_, std::move(world), links_);
  }

  SharedArena* arena() override { return one_node_ && !emulate_ ? inner_->arena() : nullptr; }
  NativeCollectives* native() override { return emulate_ ? nullptr : inner_->native(); }
  void mark_broken(const std::string& why) override { inner_->mark_broken(why); }

 private:
  std::shared_ptr<Transport> inner_;
  std::shared_ptr<const ClusterLayout> layout_;
  std::vector<int> world_;
  std::shared_ptr<LinkQueues> links_;
  bool emulate_;
  bool one_node_ = true;
};

}  // namespace

namespace {

// Rank 0 names the shared link table and sends the name to every rank.
std::shared_ptr<NodeLinkTable> share_link_table(Transport& t, int nodes, Deadline deadline) {
  constexpr uint32_t kTag = (1u << 30) - 1;  // before any call: nothing else in flight
  std::array<char, 128> name{};
  std::vector<std::unique_ptr<TransportRequest>> reqs;
  if (t.rank() == 0) {
    static std::atomic<int> counter{0};
    const std::string path =
        fmt::format("/dev/shm/meshtrain-links-{}-{}-{}", ::getpid(), counter.fetch_add(1),
                    CommClock::now().time_since_epoch().count());
    std::snprintf(name.data(), name.size(), "%s", path.c_str());
    for (int r = 1; r < t.size(); ++r) reqs.push_back(t.isend(r, kTag, name.data(), name.size()));
  } else {
    reqs.push_back(t.irecv(0, kTag, name.data(), name.size()));
  }
  for (auto& r : reqs) {
    while (!r->test()) {
      if (CommClock::now() >= deadline) {
        throw TimeoutError(fmt::format(
            "link emulation: rank {} of {} timed out exchanging the shared link table's name "
            "(rank 0 sends it to every rank when the communicator is made)",
            t.rank(), t.size()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return std::make_shared<NodeLinkTable>(std::string(name.data()), nodes, t.rank() == 0);
}

}  // namespace

std::shared_ptr<Transport> make_cluster_transport(std::shared_ptr<Transport> inner,
                                                  std::shared_ptr<const ClusterLayout> layout,
                                                  Deadline deadline) {
  if (inner->size() != layout->world()) {
    throw ConfigError(fmt::format("cluster {}: describes {} rank{}, but the communicator has {}",
                                  layout->source, layout->world(), layout->world() == 1 ? "" : "s",
                                  inner->size()));
  }
  layout->validate();
  std::vector<int> world(static_cast<size_t>(inner->size()));
  for (int r = 0; r < inner->size(); ++r) world[static_cast<size_t>(r)] = r;
  std::shared_ptr<NodeLinkTable> table;
  if (layout->sharing == LinkSharing::node_pair && layout->emulates() && inner->size() > 1) {
    table = share_link_table(*inner, layout->nodes(), deadline);
  }
  auto links = std::make_shared<LinkQueues>(inner->size(), std::move(table));
  return std::make_shared<ClusterTransport>(std::move(inner), std::move(layout), std::move(world),
                                            std::move(links));
}

}  // namespace mt
