// A tensor-parallel MLP written by hand with the collective operators, run
// against the single-process MLP (tests/spmd/tp_mlp.cpp says how and with
// which tolerance). Shared by the local-threads test and the mpirun test.
#pragma once

#include "meshtrain/comm/communicator.h"

namespace mt::test {

// Runs 10 SGD steps of both on every rank of `world` (any size dividing the
// hidden width 12) and checks, with gtest assertions, loss and gradients
// every step and the parameters at the end, plus the group communicator's
// byte counters against the operators' cost facts.
void check_tp_mlp(Communicator& world);

}  // namespace mt::test
