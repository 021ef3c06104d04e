#include "meshtrain/comm/cluster.h"

#include <algorithm>
#include <deque>
#include <mutex>

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

class LinkQueues {
 public:
  explicit LinkQueues(int world)
      : free_at_(static_cast<size_t>(world)), queue_(static_cast<size_t>(world)) {}

  // The message enters the link when the link is free (FIFO per destination:
  // a link direction carries one message at a time at its full bandwidth),
  // leaves it bytes / bandwidth later and arrives a latency after that.
  void enqueue(int dst, const std::shared_ptr<DelayedSend>& s, const LinkSpec& link) {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    Clock::time_point& free = free_at_[static_cast<size_t>(dst)];
    const Clock::time_point start = std::max(now, free);
    free = start + seconds(link.transfer_s(s->bytes));
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
    links_->enqueue(dst, s, link);
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

std::shared_ptr<Transport> make_cluster_transport(std::shared_ptr<Transport> inner,
                                                  std::shared_ptr<const ClusterLayout> layout) {
  if (inner->size() != layout->world()) {
    throw ConfigError(fmt::format("cluster {}: describes {} rank{}, but the communicator has {}",
                                  layout->source, layout->world(), layout->world() == 1 ? "" : "s",
                                  inner->size()));
  }
  layout->validate();
  std::vector<int> world(static_cast<size_t>(inner->size()));
  for (int r = 0; r < inner->size(); ++r) world[static_cast<size_t>(r)] = r;
  auto links = std::make_shared<LinkQueues>(inner->size());
  return std::make_shared<ClusterTransport>(std::move(inner), std::move(layout), std::move(world),
                                            std::move(links));
}

}  // namespace mt
