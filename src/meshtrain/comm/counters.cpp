#include "meshtrain/comm/counters.h"

#include <fmt/format.h>

namespace mt {

uint64_t CommCounters::total_sent() const {
  uint64_t s = 0;
  for (const auto& p : by_peer) s += p.bytes_sent;
  return s;
}

uint64_t CommCounters::total_received() const {
  uint64_t s = 0;
  for (const auto& p : by_peer) s += p.bytes_received;
  return s;
}

std::string CommCounters::to_json() const {
  std::string out = "{";
  for (const auto& [name, c] : by_collective) {
    out += fmt::format(
        "\"{}\": {{\"calls\": {}, \"payload_bytes\": {}, \"bytes_sent\": {}, "
        "\"bytes_received\": {}, \"seconds\": {:.6f}}}, ",
        name, c.calls, c.payload_bytes, c.bytes_sent, c.bytes_received, c.seconds);
  }
  out += "\"by_peer\": [";
  for (size_t i = 0; i < by_peer.size(); ++i) {
    out += fmt::format("{}{{\"bytes_sent\": {}, \"bytes_received\": {}}}", i ? ", " : "",
                       by_peer[i].bytes_sent, by_peer[i].bytes_received);
  }
  return out + "]}";
}

CounterBook::CounterBook(int size)
    : peers_(new PeerBytes[static_cast<size_t>(size)]), size_(static_cast<size_t>(size)) {}

void CounterBook::close_call(const std::string& key, uint64_t payload_bytes, uint64_t sent,
                             uint64_t received, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  CollectiveCounter& c = calls_[key];
  c.calls += 1;
  c.payload_bytes += payload_bytes;
  c.bytes_sent += sent;
  c.bytes_received += received;
  c.seconds += seconds;
}

CommCounters CounterBook::snapshot() const {
  CommCounters out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.by_collective = calls_;
  }
  out.by_peer.resize(size_);
  for (size_t i = 0; i < size_; ++i) {
    out.by_peer[i].bytes_sent = peers_[i].sent.load(std::memory_order_relaxed);
    out.by_peer[i].bytes_received = peers_[i].received.load(std::memory_order_relaxed);
  }
  return out;
}

void CounterBook::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.clear();
  for (size_t i = 0; i < size_; ++i) {
    peers_[i].sent.store(0, std::memory_order_relaxed);
    peers_[i].received.store(0, std::memory_order_relaxed);
  }
}

}  // namespace mt
