// meshtrain's error policy (docs/errors.md): everything that can go wrong at
// run time because of input, environment or peers is thrown as a subclass of
// mt::Error, with a message that names the cause, the place (file, key,
// operator, rank) and the values involved. Internal invariants use MT_CHECK*,
// which throw mt::InternalError printing both operands. Library code never
// calls exit() or abort(); only the CLI maps errors to exit codes.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace mt {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bug in meshtrain: a broken internal invariant.
class InternalError : public Error {
 public:
  using Error::Error;
};
// Bad configuration value, unknown key, bad command-line option.
class ConfigError : public Error {
 public:
  using Error::Error;
};
// A file that is missing, unreadable, truncated or malformed.
class FileError : public Error {
 public:
  using Error::Error;
};
// Shapes or dtypes that do not fit an operator.
class ShapeError : public Error {
 public:
  using Error::Error;
};
// A checkpoint that is truncated, tampered with, or does not match the model.
class CheckpointError : public Error {
 public:
  using Error::Error;
};
// A communication failure: a peer died, a transport error.
class CommError : public Error {
 public:
  using Error::Error;
};
// A wait that exceeded its timeout (collective, barrier, watchdog).
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};
// Ranks that disagree: mismatching collectives, diverged parameters.
class MismatchError : public CommError {
 public:
  using CommError::CommError;
};

namespace detail {
template <class A, class B>
[[noreturn]] void check_op_failed(const char* file, int line, const char* expr, const A& a,
                                  const B& b) {
  std::ostringstream os;
  os << "internal check failed at " << file << ":" << line << ": " << expr << " (" << a << " vs "
     << b << ")";
  throw InternalError(os.str());
}
[[noreturn]] inline void check_failed(const char* file, int line, const char* expr,
                                      const std::string& msg) {
  throw InternalError(fmt::format("internal check failed at {}:{}: {}{}{}", file, line, expr,
                                  msg.empty() ? "" : ": ", msg));
}
}  // namespace detail

}  // namespace mt

#define MT_CHECK(cond, ...)                                                               \
  do {                                                                                    \
    if (!(cond))                                                                          \
      ::mt::detail::check_failed(__FILE__, __LINE__, #cond, fmt::format("" __VA_ARGS__)); \
  } while (0)

#define MT_CHECK_OP_(a, b, op)                                                            \
  do {                                                                                    \
    const auto& mt_a_ = (a);                                                              \
    const auto& mt_b_ = (b);                                                              \
    if (!(mt_a_ op mt_b_))                                                                \
      ::mt::detail::check_op_failed(__FILE__, __LINE__, #a " " #op " " #b, mt_a_, mt_b_); \
  } while (0)

#define MT_CHECK_EQ(a, b) MT_CHECK_OP_(a, b, ==)
#define MT_CHECK_NE(a, b) MT_CHECK_OP_(a, b, !=)
#define MT_CHECK_LT(a, b) MT_CHECK_OP_(a, b, <)
#define MT_CHECK_LE(a, b) MT_CHECK_OP_(a, b, <=)
#define MT_CHECK_GT(a, b) MT_CHECK_OP_(a, b, >)
#define MT_CHECK_GE(a, b) MT_CHECK_OP_(a, b, >=)
