#include "meshtrain/spmd/mesh.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <set>

#include "meshtrain/base/error.h"

namespace mt {
namespace {

TEST(Mesh, CoordsRoundTripLastAxisFastest) {
  const Mesh m({{"pp", 2}, {"dp", 3}, {"tp", 2}});
  EXPECT_EQ(m.size(), 12);
  EXPECT_EQ(m.coords(0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(m.coords(1), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(m.coords(2), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(m.coords(7), (std::vector<int>{1, 0, 1}));
  for (int r = 0; r < m.size(); ++r) EXPECT_EQ(m.rank_of(m.coords(r)), r);
  EXPECT_EQ(m.coord(7, "pp"), 1);
  EXPECT_EQ(m.coord(7, "sp"), 0);  // an axis the mesh lacks
  EXPECT_EQ(m.axis_size("sp"), 1);
}

TEST(Mesh, GroupsShareEveryOtherCoordinate) {
  const Mesh m({{"pp", 2}, {"dp", 3}, {"tp", 2}});
  for (const MeshAxis& a : m.axes()) {
    std::set<int> covered;
    const auto groups = m.groups(a.name);
    EXPECT_EQ(static_cast<int>(groups.size()), m.size() / a.size);
    for (const auto& g : groups) {
      ASSERT_EQ(static_cast<int>(g.size()), a.size);
      for (size_t k = 0; k < g.size(); ++k) {
        EXPECT_EQ(m.coord(g[k], a.name), static_cast<int>(k));
        EXPECT_TRUE(covered.insert(g[k]).second) << "rank in two " << a.name << " groups";
        for (const MeshAxis& other : m.axes()) {
          if (other.name != a.name) {
            EXPECT_EQ(m.coord(g[k], other.name), m.coord(g[0], other.name));
          }
        }
        EXPECT_EQ(m.group(g[k], a.name), g);
      }
    }
    EXPECT_EQ(static_cast<int>(covered.size()), m.size());
  }
  const Mesh dt({{"dp", 2}, {"tp", 2}});
  EXPECT_EQ(dt.group(0, "tp"), (std::vector<int>{0, 1}));
  EXPECT_EQ(dt.group(3, "dp"), (std::vector<int>{1, 3}));
  EXPECT_EQ(dt.group(3, "pp"), (std::vector<int>{3}));
  EXPECT_EQ(dt.describe(), "dp=2 x tp=2");
}

TEST(Mesh, ChecksWorldAndAxes) {
  const Mesh m({{"dp", 2}, {"tp", 2}});
  EXPECT_NO_THROW(m.check_world(4, "plan"));
  try {
    m.check_world(2, "plan p.json: mesh");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "plan p.json: mesh: mesh dp=2 x tp=2 has 4 devices but the job has 2 ranks (the "
                 "mesh must cover the job's ranks exactly; start 4 ranks, e.g. --nproc 4)");
  }
  EXPECT_THROW(m.check_world(8, "plan"), ConfigError);
  try {
    Mesh({{"dp", 2}, {"dp", 2}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "mesh: axis dp is named twice");
  }
  try {
    Mesh({{"tp", 0}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "mesh: axis tp has size 0 (expected a size of at least 1)");
  }
}

}  // namespace
}  // namespace mt

namespace mt {
namespace {

// group_index(r, axis) is the position of r's group in groups(axis).
TEST(Mesh, GroupIndexIsThePositionInGroups) {
  const Mesh m({{"pp", 2}, {"dp", 3}, {"tp", 2}});
  for (const char* axis : {"pp", "dp", "tp", "sp"}) {
    const std::vector<std::vector<int>> gs = m.groups(axis);
    for (int r = 0; r < m.size(); ++r) {
      const auto& g = gs[static_cast<size_t>(m.group_index(r, axis))];
      EXPECT_NE(std::find(g.begin(), g.end(), r), g.end()) << axis << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace mt
