# Bad cluster files through the binary: each exits with status 1 before
# training, naming the file, the key and what was expected (docs/cluster.md).
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)

set(dir ${OUT}/cli_cluster_bad)
file(MAKE_DIRECTORY ${dir})
set(base ${MESHTRAIN} train --config ${SRC}/configs/mlp_fashion.toml --set train.steps=2
  --set train.eval=false)

function(bad name text)
  cmake_parse_arguments(B "" "NPROC" "EXPECT" ${ARGN})
  file(WRITE ${dir}/${name}.toml "${text}")
  set(np)
  if(B_NPROC)
    set(np --nproc ${B_NPROC})
  endif()
  expect_run(RC 1 TIMEOUT 60
    STDERR "meshtrain: error: cluster file [^\n]*${name}\\.toml: ${B_EXPECT}"
    NOT_OUTPUT "final loss" "step [0-9]+/"
    COMMAND ${base} ${np} "--set" "dist.cluster=\"${dir}/${name}.toml\"")
endfunction()

bad(negative_bandwidth "node_size = 2\n[links.inter_node]\nlatency_ms = 1\nbandwidth_gbit_s = -1\n"
  EXPECT "links\\.inter_node\\.bandwidth_gbit_s: expected a number > 0, got -1")
bad(zero_bandwidth "node_size = 2\n[links.inter_site]\nbandwidth_gbit_s = 0\n"
  EXPECT "links\\.inter_site\\.bandwidth_gbit_s: expected a number > 0, got 0")
bad(negative_latency "node_size = 2\n[links.intra_node]\nlatency_ms = -0.5\n"
  EXPECT "links\\.intra_node\\.latency_ms: expected a number >= 0, got -0\\.5")
bad(missing_node
  "[[nodes]]\nname = \"a\"\nranks = [0]\n[[nodes]]\nname = \"b\"\nranks = [1]\n[[link_pairs]]\nnodes = [\"a\", \"c\"]\nlatency_ms = 5\n"
  EXPECT "link_pairs\\[0\\]\\.nodes\\[1\\]: no node \"c\" \\(the nodes are \"a\", \"b\"\\)")
bad(site_missing_node
  "[[nodes]]\nname = \"a\"\nranks = [0, 1]\n[[sites]]\nname = \"eu\"\nnodes = [\"a\", \"z\"]\n"
  EXPECT "sites\\[0\\]\\.nodes\\[1\\]: no node \"z\"")
bad(rank_in_two_nodes
  "[[nodes]]\nname = \"a\"\nranks = [0, 1]\n[[nodes]]\nname = \"b\"\nranks = [1, 2]\n"
  EXPECT "nodes\\[1\\]\\.ranks: rank 1 is already on node \"a\" \\(a rank belongs to one node\\)")
bad(not_covering
  "[[nodes]]\nname = \"a\"\nranks = [0, 1]\n[[nodes]]\nname = \"b\"\nranks = [3]\n" NPROC 4
  EXPECT "nodes: the nodes do not cover the job's 4 ranks: rank 2 is on no node")
bad(unknown_key "node_size = 2\n[links.inter_node]\nlatency_ms = 1\nbandwith_gbit_s = 1\n"
  EXPECT "links\\.inter_node\\.bandwith_gbit_s: unknown key \\(expected latency_ms, bandwidth_gbit_s\\)")
bad(slowdown_count "node_size = 1\n[ranks]\nslowdown = [1, 3]\n" NPROC 4
  EXPECT "ranks\\.slowdown: 2 factors given for 4 ranks \\(expected one factor per rank\\)")

# A file that does not exist, and both ways of grouping at once.
expect_run(RC 1 TIMEOUT 60 STDERR "cluster file ${dir}/absent\\.toml: cannot read it"
  NOT_OUTPUT "final loss" COMMAND ${base} "--set" "dist.cluster=\"${dir}/absent.toml\"")
expect_run(RC 1 TIMEOUT 60
  STDERR "dist\\.node_size = 2 and dist\\.cluster = \"[^\"]*\" both group ranks into nodes"
  NOT_OUTPUT "final loss"
  COMMAND ${base} --set dist.node_size=2 "--set" "dist.cluster=\"${dir}/negative_latency.toml\"")
message(STATUS "ok: bad cluster files rejected")
