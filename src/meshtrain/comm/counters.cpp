#include "meshtrain/comm/counters.h"

#include <fmt/format.h>

#include "meshtrain/comm/options.h"

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

void CounterBook::close_call(int key, uint64_t payload_bytes, uint64_t sent, uint64_t received,
                             int64_t nanoseconds) {
  CallTotals& c = calls_[key];
  c.calls.fetch_add(1, std::memory_order_relaxed);
  c.payload.fetch_add(payload_bytes, std::memory_order_relaxed);
  c.sent.fetch_add(sent, std::memory_order_relaxed);
  c.received.fetch_add(received, std::memory_order_relaxed);
  c.nanoseconds.fetch_add(nanoseconds, std::memory_order_relaxed);
}

CommCounters CounterBook::snapshot() const {
  CommCounters out;
  for (int k = 0; k < kKeys; ++k) {
    const CallTotals& c = calls_[k];
    const uint64_t calls = c.calls.load(std::memory_order_relaxed);
    if (calls == 0) continue;
    CollectiveCounter& o =
        out.by_collective[k == kHandshake
                              ? std::string("handshake")
                              : std::string(collective_name(static_cast<Collective>(k)))];
    o.calls = calls;
    o.payload_bytes = c.payload.load(std::memory_order_relaxed);
    o.bytes_sent = c.sent.load(std::memory_order_relaxed);
    o.bytes_received = c.received.load(std::memory_order_relaxed);
    o.seconds = static_cast<double>(c.nanoseconds.load(std::memory_order_relaxed)) * 1e-9;
  }
  out.by_peer.resize(size_);
  for (size_t i = 0; i < size_; ++i) {
    out.by_peer[i].bytes_sent = peers_[i].sent.load(std::memory_order_relaxed);
    out.by_peer[i].bytes_received = peers_[i].received.load(std::memory_order_relaxed);
  }
  return out;
}

void CounterBook::reset() {
  for (CallTotals& c : calls_) {
    c.calls.store(0, std::memory_order_relaxed);
    c.payload.store(0, std::memory_order_relaxed);
    c.sent.store(0, std::memory_order_relaxed);
    c.received.store(0, std::memory_order_relaxed);
    c.nanoseconds.store(0, std::memory_order_relaxed);
  }
  for (size_t i = 0; i < size_; ++i) {
    peers_[i].sent.store(0, std::memory_order_relaxed);
    peers_[i].received.store(0, std::memory_order_relaxed);
  }
}

}  // namespace mt
