// MPI's own collectives as the `native` algorithm: started nonblocking
// (MPI_I*), polled by the communicator against its deadline. bf16 and f16
// reduce through user-defined MPI operations that call the comm layer's
// kernels (f32 arithmetic, one rounding per combine).
#include <climits>
#include <mutex>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/mpi/mpi_request.h"
#include "meshtrain/comm/backends/mpi/mpi_runtime.h"
#include "meshtrain/comm/backends/mpi/mpi_transport.h"
#include "meshtrain/comm/reduce.h"

namespace mt {
namespace {

template <DType D, ReduceOp Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  comm::combine(inout, inout, in, static_cast<size_t>(*len), D, Op);
}

struct HalfOps {
  MPI_Op ops[2][3];  // [bf16, f16][sum, max, min]
  HalfOps() {
    MPI_Op_create(&half_op<DType::bf16, ReduceOp::sum>, 1, &ops[0][0]);
    MPI_Op_create(&half_op<DType::bf16, ReduceOp::max>, 1, &ops[0][1]);
    MPI_Op_create(&half_op<DType::bf16, ReduceOp::min>, 1, &ops[0][2]);
    MPI_Op_create(&half_op<DType::f16, ReduceOp::sum>, 1, &ops[1][0]);
    MPI_Op_create(&half_op<DType::f16, ReduceOp::max>, 1, &ops[1][1]);
    MPI_Op_create(&half_op<DType::f16, ReduceOp::min>, 1, &ops[1][2]);
  }
};

// Created once, on first use, while holding the runtime lock.
const HalfOps& half_ops() {
  static HalfOps ops;
  return ops;
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(DType t, ReduceOp op) {
  const int which = op == ReduceOp::max ? 1 : op == ReduceOp::min ? 2 : 0;
  if (t == DType::bf16) return half_ops().ops[0][which];
  if (t == DType::f16) return half_ops().ops[1][which];
  return which == 1 ? MPI_MAX : which == 2 ? MPI_MIN : MPI_SUM;
}

class MpiNative : public NativeCollectives {
 public:
  MpiNative(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}

  std::string engine_name() const override { return MpiRuntime::instance().library(); }

  bool supports(Collective c, DType dtype, ReduceOp /*op*/, size_t max_count) const override {
    // Byte-based calls pass count * element size as an int.
    const bool fits =
        max_count * dtype_size(dtype) <= static_cast<size_t>(INT_MAX) &&
        max_count * static_cast<size_t>(size_) * dtype_size(dtype) <= static_cast<size_t>(INT_MAX);
    return fits && c != Collective::send && c != Collective::recv;
  }

  std::unique_ptr<TransportRequest> all_reduce(const void* send, void* recv, size_t count,
                                               DType dtype, ReduceOp op) override {
    auto r = start("MPI_Iallreduce");
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                         mpi_type(dtype), mpi_op(dtype, op), comm_, &r->reqs[0]),
          "MPI_Iallreduce");
    return r;
  }

  std::unique_ptr<TransportRequest> all_gather(const void* send, void* recv, size_t count,
                                               DType dtype) override {
    auto r = start("MPI_Iallgather");
    const int bytes = static_cast<int>(count * dtype_size(dtype));
    const bool in_place = send == static_cast<std::byte*>(recv) +
                                      static_cast<size_t>(rank_) * static_cast<size_t>(bytes);
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, bytes, MPI_BYTE, recv, bytes, MPI_BYTE,
                         comm_, &r->reqs[0]),
          "MPI_Iallgather");
    return r;
  }

  std::unique_ptr<TransportRequest> all_gatherv(const void* send, void* recv,
                                                std::span<const size_t> counts,
                                                DType dtype) override {
    auto r = start("MPI_Iallgatherv");
    byte_layout(counts, dtype_size(dtype), r->keep[0], r->keep[1]);
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Iallgatherv(send, r->keep[0][static_cast<size_t>(rank_)], MPI_BYTE, recv,
                          r->keep[0].data(), r->keep[1].data(), MPI_BYTE, comm_, &r->reqs[0]),
          "MPI_Iallgatherv");
    return r;
  }

  std::unique_ptr<TransportRequest> reduce_scatter(const void* send, void* recv, size_t recv_count,
                                                   DType dtype, ReduceOp op) override {
    auto r = start("MPI_Ireduce_scatter_block");
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Ireduce_scatter_block(send, recv, static_cast<int>(recv_count), mpi_type(dtype),
                                    mpi_op(dtype, op), comm_, &r->reqs[0]),
          "MPI_Ireduce_scatter_block");
    return r;
  }

  std::unique_ptr<TransportRequest> reduce_scatterv(const void* send, void* recv,
                                                    std::span<const size_t> counts, DType dtype,
                                                    ReduceOp op) override {
    auto r = start("MPI_Ireduce_scatter");
    for (size_t c : counts) r->keep[0].push_back(static_cast<int>(c));
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Ireduce_scatter(send, recv, r->keep[0].data(), mpi_type(dtype), mpi_op(dtype, op),
                              comm_, &r->reqs[0]),
          "MPI_Ireduce_scatter");
    return r;
  }

  std::unique_ptr<TransportRequest> broadcast(void* buf, size_t count, DType dtype,
                                              int root) override {
    auto r = start("MPI_Ibcast");
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Ibcast(buf, static_cast<int>(count * dtype_size(dtype)), MPI_BYTE, root, comm_,
                     &r->reqs[0]),
          "MPI_Ibcast");
    return r;
  }

  std::unique_ptr<TransportRequest> all_to_allv(const void* send,
                                                std::span<const size_t> send_counts, void* recv,
                                                std::span<const size_t> recv_counts,
                                                DType dtype) override {
    auto r = start("MPI_Ialltoallv");
    byte_layout(send_counts, dtype_size(dtype), r->keep[0], r->keep[1]);
    byte_layout(recv_counts, dtype_size(dtype), r->keep[2], r->keep[3]);
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Ialltoallv(send, r->keep[0].data(), r->keep[1].data(), MPI_BYTE, recv,
                         r->keep[2].data(), r->keep[3].data(), MPI_BYTE, comm_, &r->reqs[0]),
          "MPI_Ialltoallv");
    return r;
  }

  std::unique_ptr<TransportRequest> barrier() override {
    auto r = start("MPI_Ibarrier");
    auto lock = MpiRuntime::instance().lock();
    check(MPI_Ibarrier(comm_, &r->reqs[0]), "MPI_Ibarrier");
    return r;
  }

 private:
  std::unique_ptr<MpiRequest> start(const char* what) const {
    auto r = std::make_unique<MpiRequest>(true, what);
    r->reqs.assign(1, MPI_REQUEST_NULL);
    return r;
  }
  void check(int rc, const char* call) const {
    if (rc != MPI_SUCCESS) {
      throw CommError(fmt::format("mpi rank {}: {} failed: {}", rank_, call, mpi_error_string(rc)));
    }
  }
  static void byte_layout(std::span<const size_t> counts, size_t elem, std::vector<int>& bytes,
                          std::vector<int>& displs) {
    size_t off = 0;
    for (size_t c : counts) {
      bytes.push_back(static_cast<int>(c * elem));
      displs.push_back(static_cast<int>(off));
      off += c * elem;
    }
  }

  MPI_Comm comm_;
  int rank_;
  int size_;
};

}  // namespace

std::unique_ptr<NativeCollectives> make_mpi_native(MPI_Comm comm, int rank, int size) {
  return std::make_unique<MpiNative>(comm, rank, size);
}

}  // namespace mt
