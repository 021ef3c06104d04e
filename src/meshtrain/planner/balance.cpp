#include "meshtrain/planner/balance.h"

#include <glpk.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "meshtrain/base/error.h"

namespace mt::planner {

namespace {

double at(const std::vector<double>& v, size_t i, double fallback) {
  return v.empty() ? fallback : v[i];
}

void check(const BalanceProblem& p) {
  const size_t n = p.time_per_unit.size();
  if (n == 0) throw ConfigError("balance: no devices to share " + p.what + " over");
  for (const auto* v : {&p.fixed_time, &p.max_units, &p.min_units}) {
    if (!v->empty() && v->size() != n) {
      throw ConfigError(fmt::format("balance: {} bounds or times for {} devices", v->size(), n));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!(p.time_per_unit[i] > 0)) {
      throw ConfigError(fmt::format("balance: device {}'s time per unit must be > 0, got {}", i,
                                    p.time_per_unit[i]));
    }
  }
  double lo = 0, hi = 0;
  for (size_t i = 0; i < n; ++i) {
    lo += at(p.min_units, i, 0);
    hi += at(p.max_units, i, std::numeric_limits<double>::infinity());
    if (at(p.max_units, i, 1e300) < at(p.min_units, i, 0)) {
      throw ConfigError(
          fmt::format("device {} needs at least {} {} but memory allows at most {} ({} short)", i,
                      at(p.min_units, i, 0), p.what, at(p.max_units, i, 0),
                      at(p.min_units, i, 0) - at(p.max_units, i, 0)));
    }
  }
  if (hi < p.total) {
    throw ConfigError(fmt::format("memory allows at most {} {} in all, {} short of the {} to share",
                                  hi, p.what, p.total - hi, p.total));
  }
  if (lo > p.total) {
    throw ConfigError(
        fmt::format("the devices need at least {} {} in all, {} more than the {} "
                    "to share",
                    lo, p.what, lo - p.total, p.total));
  }
}

}  // namespace

Balance balance_lp(const BalanceProblem& p) {
  check(p);
  const int n = static_cast<int>(p.time_per_unit.size());
  // GLPK keeps an environment per thread (the plan search solves on worker
  // threads); free it when this solve's problem is gone, so no thread
  // leaves one behind. Declared first: destroyed after the problem.
  struct Env {
    Env() { glp_term_out(GLP_OFF); }
    ~Env() { glp_free_env(); }
    Env(const Env&) = delete;
    Env& operator=(const Env&) = delete;
  } env;
  std::unique_ptr<glp_prob, void (*)(glp_prob*)> lp(glp_create_prob(), glp_delete_prob);
  glp_set_obj_dir(lp.get(), GLP_MIN);
  // Columns 1..n: x_i; column n+1: T.
  glp_add_cols(lp.get(), n + 1);
  for (int i = 0; i < n; ++i) {
    const double lo = at(p.min_units, static_cast<size_t>(i), 0);
    const double hi = at(p.max_units, static_cast<size_t>(i), -1);
    if (hi >= 0) {
      glp_set_col_bnds(lp.get(), i + 1, hi > lo ? GLP_DB : GLP_FX, lo, hi);
    } else {
      glp_set_col_bnds(lp.get(), i + 1, GLP_LO, lo, 0);
    }
  }
  glp_set_col_bnds(lp.get(), n + 1, GLP_LO, 0, 0);
  glp_set_obj_coef(lp.get(), n + 1, 1.0);
  // Rows 1..n: a_i x_i - T <= -b_i; row n+1: sum x_i = total.
  glp_add_rows(lp.get(), n + 1);
  std::vector<int> ia(1), ja(1);
  std::vector<double> ar(1);
  for (int i = 0; i < n; ++i) {
    glp_set_row_bnds(lp.get(), i + 1, GLP_UP, 0, -at(p.fixed_time, static_cast<size_t>(i), 0));
    ia.push_back(i + 1), ja.push_back(i + 1), ar.push_back(p.time_per_unit[static_cast<size_t>(i)]);
    ia.push_back(i + 1), ja.push_back(n + 1), ar.push_back(-1.0);
    ia.push_back(n + 1), ja.push_back(i + 1), ar.push_back(1.0);
  }
  glp_set_row_bnds(lp.get(), n + 1, GLP_FX, p.total, p.total);
  glp_load_matrix(lp.get(), static_cast<int>(ia.size()) - 1, ia.data(), ja.data(), ar.data());
  glp_smcp parm;
  glp_init_smcp(&parm);
  parm.msg_lev = GLP_MSG_OFF;
  const int rc = glp_simplex(lp.get(), &parm);
  if (rc != 0 || glp_get_status(lp.get()) != GLP_OPT) {
    throw ConfigError(
        fmt::format("balance: the linear program for {} has no optimum (GLPK "
                    "return code {}, status {})",
                    p.what, rc, glp_get_status(lp.get())));
  }
  Balance b;
  for (int i = 0; i < n; ++i) b.units.push_back(glp_get_col_prim(lp.get(), i + 1));
  b.time = glp_get_obj_val(lp.get());
  return b;
}

std::vector<int64_t> round_shares(const BalanceProblem& p, const Balance& lp) {
  check(p);
  const size_t n = p.time_per_unit.size();
  const auto total = static_cast<int64_t>(std::llround(p.total));
  std::vector<int64_t> x(n), lo(n), hi(n);
  int64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    lo[i] = static_cast<int64_t>(std::ceil(at(p.min_units, i, 0) - 1e-9));
    hi[i] = p.max_units.empty() ? total : static_cast<int64_t>(std::floor(p.max_units[i] + 1e-9));
    x[i] = std::clamp(static_cast<int64_t>(std::floor(lp.units[i] + 1e-9)), lo[i], hi[i]);
    sum += x[i];
  }
  auto finish = [&](size_t i, int64_t units) {
    return p.time_per_unit[i] * static_cast<double>(units) + at(p.fixed_time, i, 0);
  };
  // Too many after clamping to the lower bounds: take units back from the
  // devices that finish last (while above their bound).
  while (sum > total) {
    size_t worst = n;
    for (size_t i = 0; i < n; ++i) {
      if (x[i] > lo[i] && (worst == n || finish(i, x[i]) > finish(worst, x[worst]))) worst = i;
    }
    if (worst == n)
      throw ConfigError(fmt::format("balance: no whole split of {} {}", total, p.what));
    --x[worst], --sum;
  }
  while (sum < total) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i) {
      if (x[i] < hi[i] && (best == n || finish(i, x[i] + 1) < finish(best, x[best] + 1))) best = i;
    }
    if (best == n) {
      throw ConfigError(fmt::format("memory allows at most {} whole {} in all, {} short of {}", sum,
                                    p.what, total - sum, total));
    }
    ++x[best], ++sum;
  }
  return x;
}

double finish_time(const BalanceProblem& p, const std::vector<int64_t>& shares) {
  double t = 0;
  for (size_t i = 0; i < shares.size(); ++i) {
    t = std::max(t, p.time_per_unit[i] * static_cast<double>(shares[i]) + at(p.fixed_time, i, 0));
  }
  return t;
}

}  // namespace mt::planner
