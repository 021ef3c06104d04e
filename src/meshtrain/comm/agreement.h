// The pre-collective handshake's record: what one rank is about to call.
// Ranks exchange records (over shared memory or directly) and compare them;
// since every rank sees every record, a mismatch raises the same
// MismatchError, with the same message, on every rank.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "meshtrain/comm/collective_context.h"

namespace mt::comm {

struct CallRecord {
  uint64_t seq = 0;
  uint64_t count = 0;
  uint64_t counts_hash = 0;  // v-variants: hash of the per-rank counts
  uint64_t bytes = 0;        // informational (all_to_allv payloads differ by rank)
  uint32_t tag = 0;
  int32_t root = -1;
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t op = 0;
  uint8_t algorithm = 0;  // as requested by the caller (automatic or explicit)
  uint8_t valid = 1;
  uint8_t pad[3] = {};
};
// Fits a cache line together with the count that publishes it.
static_assert(sizeof(CallRecord) == 48);

uint64_t hash_counts(std::span<const size_t> counts);
// The record for `call`; fields that do not apply to its collective are zero.
CallRecord make_record(const CallInfo& call, uint64_t counts_hash, CommAlgorithm requested);
// "all_reduce #5 (f32 x 1000, sum, algorithm automatic)"
std::string describe_record(const CallRecord& r);
// nullopt when all records agree; otherwise a message naming each rank's call,
// identical on every rank that evaluates the same records.
std::optional<std::string> find_mismatch(const std::string& comm_name,
                                         std::span<const CallRecord> records);

}  // namespace mt::comm
