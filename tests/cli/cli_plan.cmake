# Parallel plans through the binary (no rank starts): inspect prints the
# mesh, per-rank coordinates and groups, specs with local shapes, stages and
# the schedule, and for plans with tensor axes every rank's lowered program;
# --write-plan writes the plan and --plan reads it back; train runs data- and
# tensor-parallel plans and refuses pipeline plans (exit 1, naming why), and
# bad plans are rejected before any step naming the key.
cmake_minimum_required(VERSION 3.25)
set(mlp --config ${SRC}/configs/mlp_fashion.toml)
set(gpt --config ${SRC}/configs/gpt_text.toml --set model.layers=2 --set model.d_model=32
  --set model.seq_len=8 --set train.batch_size=8)
set(quick --quiet --set train.threads=1 --set train.steps=2 --set train.eval=false
  "--set" "train.checkpoint=\"\"")
set(dir ${OUT}/cli_plan)
if(MPIRUN)
  set(dir ${OUT}/cli_plan_mpirun)  # the two variants may run at once
endif()
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir})

function(run rc_want out_pattern err_pattern)
  execute_process(COMMAND ${MESHTRAIN} ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  if(NOT rc EQUAL rc_want)
    message(FATAL_ERROR "${ARGN}: exit ${rc}, expected ${rc_want}:\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "${out_pattern}")
    message(FATAL_ERROR "${ARGN}: stdout does not match '${out_pattern}':\n${out}\n${err}")
  endif()
  if(NOT err MATCHES "${err_pattern}")
    message(FATAL_ERROR "${ARGN}: stderr does not match '${err_pattern}':\n${err}")
  endif()
  if(rc EQUAL 1 AND (err MATCHES "MPI_ABORT|mpirun" OR out MATCHES "steps [0-9]"))
    message(FATAL_ERROR "${ARGN}: a rank or a step ran:\n${out}\n${err}")
  endif()
endfunction()

# Under a plain mpirun: tensor- and pipeline-parallel plans train; what a
# pipeline does not carry yet (checkpoints) is refused by every rank, exit
# status 1 and the error, no hang (label "mpi").
if(MPIRUN)
  execute_process(COMMAND ${MPIRUN} --allow-run-as-root --oversubscribe --bind-to none -np 2
      ${MESHTRAIN} train ${mlp} --set train.threads=1 --set train.steps=2 --set train.eval=false
      "--set" "train.checkpoint=\"\"" --set parallel.tp=2
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "steps 2  final loss" OR NOT err MATCHES "mesh dp=1 x tp=2: tensor axes lowered into each rank's graph")
    message(FATAL_ERROR "mpirun -np 2 with tp=2: exit ${rc}:\n${out}\n${err}")
  endif()
  execute_process(COMMAND ${MPIRUN} --allow-run-as-root --oversubscribe --bind-to none -np 2
      ${MESHTRAIN} train ${mlp} ${quick} --set parallel.pp=2 --set parallel.microbatches=2
      --metrics ${dir}/pp_metrics.jsonl
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "steps 2  final loss")
    message(FATAL_ERROR "mpirun -np 2 with pp=2: exit ${rc}:\n${out}\n${err}")
  endif()
  # The summary gives both stages' allocator counters and peak RSS.
  file(READ ${dir}/pp_metrics.jsonl lines)
  string(REGEX MATCH "{[^\n]*\"summary\":true[^\n]*}" summary "${lines}")
  string(JSON rank1_params GET "${summary}" ranks 1 mem_peak_bytes params)
  string(JSON rank1_rss GET "${summary}" ranks 1 peak_rss_bytes)
  if(NOT rank1_params GREATER 0 OR NOT rank1_rss GREATER 0)
    message(FATAL_ERROR "pp=2 summary lacks rank 1's memory: ${summary}")
  endif()
  # A checkpoint written under pp=2 resumes under data parallelism.
  execute_process(COMMAND ${MPIRUN} --allow-run-as-root --oversubscribe --bind-to none -np 2
      ${MESHTRAIN} train ${mlp} --quiet --set train.threads=1 --set train.steps=4
      --set train.halt_after=2 --set train.eval=false
      --set parallel.pp=2 --set parallel.microbatches=2 --set data.limit_test=200
      "--set" "train.checkpoint=\"${dir}/pp_ckpt\""
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "checkpoint: ${dir}/pp_ckpt")
    message(FATAL_ERROR "mpirun -np 2 with pp=2 and a checkpoint: exit ${rc}:\n${out}\n${err}")
  endif()
  execute_process(COMMAND ${MPIRUN} --allow-run-as-root --oversubscribe --bind-to none -np 2
      ${MESHTRAIN} train ${mlp} --quiet --set train.threads=1 --set train.steps=4
      --set train.eval=false "--set" "train.checkpoint=\"${dir}/pp_ckpt\""
      "--set" "train.resume=\"${dir}/pp_ckpt\""
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "steps 4  final loss" OR NOT err MATCHES "resumed from step 2")
    message(FATAL_ERROR "mpirun -np 2 resuming a pp=2 checkpoint under dp: exit ${rc}:\n${out}\n${err}")
  endif()
  return()
endif()

# inspect with the shorthand: GPT on 8 ranks, pp=2 x dp=2 x tp=2.
run(0 "mesh: pp=2 x dp=2 x tp=2 \\(8 ranks.*rank 5: pp=1 dp=0 tp=1; groups: pp \\[1, 5\\]; dp \\[5, 7\\]; tp \\[4, 5\\].*block1.attn.q.w \\[32, 32\\] f32: \\[-, tp unit 8\\].*ranks 5,7: \\[32, 16\\] \\[0:32, 16:32\\] 2048 B.*stage 1 \\(ranks 4,5,6,7\\): block1 ln_f.*stage 0: F0@0 send_act0@0->1 F1@0.*idle fraction 0.2000.*meshtrain train runs this plan through the pipeline runtime" ""
  inspect ${gpt} --set dist.nproc=8 --set parallel.tp=2 --set parallel.pp=2
  --set parallel.microbatches=4)
# --write-plan writes it and stops; --plan reads it back (same mesh and stages).
run(0 "wrote the plan to ${dir}/tp.json" ""
  inspect ${gpt} --set dist.nproc=8 --set parallel.tp=2 --set parallel.pp=2
  --set parallel.microbatches=4 --write-plan ${dir}/tp.json)
file(READ ${dir}/tp.json tp_json)
if(NOT tp_json MATCHES "\"block0.attn.q.w\": {\"dims\":\\[null,{\"axis\":\"tp\",\"unit\":8}\\]}")
  message(FATAL_ERROR "tp.json lacks the column split of q:\n${tp_json}")
endif()
run(0 "mesh: pp=2 x dp=2 x tp=2.*stage 1 \\(ranks 4,5,6,7\\): block1 ln_f" ""
  inspect ${gpt} --set dist.nproc=8 --plan ${dir}/tp.json)
# Micro-batches without pipeline stages are refused before any rank starts.
run(1 "" "error: parallel.microbatches: 2 micro-batches need a pipeline \\(parallel.pp > 1\\)"
  train ${gpt} ${quick} --set parallel.tp=2 --set parallel.microbatches=2 --nproc 2)
# Tensor axes inside a pipeline (pp=2 x tp=2) train.
run(0 "steps 2  final loss" "wrote the plan to ${dir}/tpp.json"
  train ${gpt} ${quick} --set parallel.pp=2 --set parallel.tp=2 --set parallel.microbatches=2
  --nproc 4 --write-plan ${dir}/tpp.json)
# A pipeline plan trains and evaluates (the whole model joined per replica).
run(0 "steps 2  final loss.*final test accuracy" "" train ${gpt} --quiet --set train.threads=1
  --set train.steps=2 --set train.eval_batches=1 "--set" "train.checkpoint=\"\""
  --set parallel.pp=2 --set parallel.microbatches=4 --set parallel.schedule=\"gpipe\" --nproc 2)
# ZBV with recomputation on its first stage trains; --trace writes each
# pass per micro-batch and stage (with its CPU time), the waits and the
# transfers; inspect prints the planned stash per rank.
run(0 "steps 2  final loss" "" train ${gpt} --set model.layers=4 --quiet --set train.threads=1
  --set train.steps=2 --set train.eval=false "--set" "train.checkpoint=\"\"" --set parallel.pp=2
  --set parallel.microbatches=2 --set parallel.schedule=\"zbv\" --set parallel.virtual_stages=2
  --set parallel.recompute=[0] --trace ${dir}/zbv_trace.json --nproc 2)
file(READ ${dir}/zbv_trace.json trace)
foreach(want "\"F1@3\"" "\"BI0@2\"" "\"BW1@1\"" "\"B1@0\"" "cpu_ms" "wait recv_act" "send 4096B")
  string(FIND "${trace}" "${want}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the zbv trace has no ${want}")
  endif()
endforeach()
run(0 "stage 0 \\(ranks 0\\): wte wpe block0 \\(recomputed\\).*stage 3 \\(ranks 0\\).*pipeline activation stash.*recomputed: keeps 0 bytes.*rank 1: planned peak stash [0-9]+ bytes" ""
  inspect ${gpt} --set model.layers=4 --set dist.nproc=2 --set parallel.pp=2
  --set parallel.microbatches=2 --set parallel.schedule=\"zbv\" --set parallel.virtual_stages=2
  --set parallel.recompute=[0])
# Tensor parallelism: inspect prints each rank's program (its boxes, the
# inserted collectives with bytes, its memory); train writes the plan and runs it.
run(0 "per-rank programs.*rank 1: [0-9]+ operators.*param block0.attn.q.w \\[32, 32\\] -> \\[0:32, 16:32\\] over tp.*forward  copy_to_group.*backward reduce_from_group.*collective payload per step.*planned memory" ""
  inspect ${gpt} --set dist.nproc=2 --set parallel.tp=2)
run(0 "steps 2  final loss" "wrote the plan to ${dir}/again.json"
  train ${gpt} ${quick} --set parallel.tp=2 --nproc 2 --write-plan ${dir}/again.json)
if(NOT EXISTS ${dir}/again.json)
  message(FATAL_ERROR "train --write-plan did not write ${dir}/again.json")
endif()
run(0 "steps 2  final loss" "" train ${gpt} ${quick} --nproc 2 --plan ${dir}/again.json)
# A checkpoint directory under tensor parallelism (N-d pieces) resumes
# under data parallelism.
run(0 "steps 2  final loss.*checkpoint: ${dir}/tp_ckpt" ""
  train ${gpt} --quiet --set train.threads=1 --set train.steps=4 --set train.halt_after=2
  --set train.eval=false --set parallel.tp=2 --nproc 2 "--set" "train.checkpoint=\"${dir}/tp_ckpt\"")
run(0 "steps 4  final loss" ""
  train ${gpt} --quiet --set train.threads=1 --set train.steps=4 --set train.eval=false --nproc 2
  "--set" "train.checkpoint=\"${dir}/tp_ckpt\"" "--set" "train.resume=\"${dir}/tp_ckpt\"")
# Its weights, exported, start a tensor-parallel run (train.init: each rank
# keeps its boxes).
run(0 "exported gpt" "" export ${gpt} "--set" "train.checkpoint=\"${dir}/tp_ckpt\""
  --out ${dir}/gpt.safetensors)
run(0 "steps 2  final loss" "initialised [0-9]+ tensors \\([0-9]+ values\\) from ${dir}/gpt.safetensors"
  train ${gpt} ${quick} --set parallel.tp=2 --nproc 2 "--set" "train.init=\"${dir}/gpt.safetensors\"")
run(0 "steps 2  final loss" "initialised [0-9]+ tensors \\([0-9]+ values\\) from ${dir}/gpt.safetensors"
  train ${gpt} ${quick} --set parallel.tp=2 --set parallel.pp=2 --set parallel.microbatches=2
  --nproc 4 "--set" "train.init=\"${dir}/gpt.safetensors\"")
# A data-parallel plan runs as today's data parallelism.
run(0 "wrote the plan to ${dir}/dp.json" "" inspect ${mlp} --write-plan ${dir}/dp.json)
run(0 "steps 2  final loss" "" train ${mlp} ${quick} --plan ${dir}/dp.json)

# A data-parallel plan whose batch split is not the loader's is refused.
run(0 "wrote the plan" "" inspect ${mlp} --set dist.nproc=2 --write-plan ${dir}/dp2.json)
run(1 "" "error: plan ${dir}/dp2.json: values.x: rank 0 would read rows \\[0, 64\\) of 128, but data parallelism gives it \\[0, 85\\) \\(dist.batch_shares \\[2, 1\\]\\)"
  train ${mlp} ${quick} --nproc 2 --plan ${dir}/dp2.json "--set" "dist.batch_shares=[2,1]")

# "devices": which world rank runs each mesh rank; a permutation trains, a
# list that is none is refused before any rank starts, naming the entry.
file(READ ${dir}/dp2.json dp2)
string(REGEX REPLACE "}[ \n]*$" ",\"devices\": [1, 0]}\n" swapped "${dp2}")
file(WRITE ${dir}/dp2_swapped.json "${swapped}")
run(0 "steps 2  final loss" "" train ${mlp} ${quick} --nproc 2 --plan ${dir}/dp2_swapped.json)
string(REGEX REPLACE "}[ \n]*$" ",\"devices\": [0, 0]}\n" twice "${dp2}")
file(WRITE ${dir}/dp2_twice.json "${twice}")
run(1 "" "error: plan ${dir}/dp2_twice.json: devices\\[1\\]: world rank 0 already runs mesh rank 0 \\(a permutation of the job's ranks: each once\\)"
  train ${mlp} ${quick} --nproc 2 --plan ${dir}/dp2_twice.json)

# Stages on different meshes (docs/plan.md): inspect prints each stage's
# mesh and the boundary's reshard bytes; train runs it at 3 ranks and writes
# a checkpoint that a single process resumes; a stage mesh that does not
# match its ranks is refused before any rank starts.
set(xmesh "{\"model\": \"mlp\", \"mesh\": [{\"name\": \"world\", \"size\": 3}],
  \"values\": {\"fc1.w\": {\"dims\": [null, \"tp\"]}, \"fc1.b\": {\"dims\": [\"tp\"]}},
  \"stages\": [
    {\"layers\": [\"fc1\"], \"ranks\": [0, 1], \"mesh\": [{\"name\": \"tp\", \"size\": MESH0}]},
    {\"layers\": [\"fc2\", \"head\"], \"ranks\": [2], \"mesh\": []}],
  \"microbatches\": 2}")
string(REPLACE "MESH0" "2" xmesh_ok "${xmesh}")
file(WRITE ${dir}/xmesh.json "${xmesh_ok}")
run(0 "stage 0 \\(ranks 0,1; mesh tp=2\\): fc1.*boundary stage 0 -> 1: relu_2 \\[64, 512\\] f32.*forward per micro-batch: 131072 B in all \\(0:65536 1:65536\\).*boundary bytes per rank per step: 0:131072 1:131072 2:262144"
  "" inspect ${mlp} --set dist.nproc=3 --plan ${dir}/xmesh.json)
run(0 "steps 2  final loss" "" train ${mlp} ${quick} --nproc 3 --plan ${dir}/xmesh.json)
run(0 "steps 2  final loss" "" train ${mlp} ${quick} --nproc 3 --plan ${dir}/xmesh.json
  "--set" "train.checkpoint=\"${dir}/xmesh_ck\"")
run(0 "steps 4  final loss" "resumed from step 2" train ${mlp} ${quick} --set train.steps=4
  "--set" "train.resume=\"${dir}/xmesh_ck\"")
# Two model replicas of it over a dp axis (the stages list one replica's
# ranks), with ZeRO-1 on it.
string(REPLACE "\"mesh\": [{\"name\": \"world\", \"size\": 3}]"
  "\"mesh\": [{\"name\": \"dp\", \"size\": 2}, {\"name\": \"world\", \"size\": 3}]"
  xmesh_dp "${xmesh_ok}")
string(REPLACE "\"values\": {" "\"values\": {\"x\": {\"dims\": [\"dp\"]}, \"y\": {\"dims\": [\"dp\"]}, "
  xmesh_dp "${xmesh_dp}")
file(WRITE ${dir}/xmesh_dp.json "${xmesh_dp}")
run(0 "steps 2  final loss" "" train ${mlp} ${quick} --nproc 6 --plan ${dir}/xmesh_dp.json
  --set dist.zero_stage=1)
string(REPLACE "MESH0" "3" xmesh_bad "${xmesh}")
file(WRITE ${dir}/xmesh_bad.json "${xmesh_bad}")
run(1 "" "error: plan ${dir}/xmesh_bad.json: stages\\[0\\].mesh: tp=3 has 3 devices but the stage has 2 ranks \\(0, 1\\); expected a mesh of 2"
  train ${mlp} ${quick} --nproc 3 --plan ${dir}/xmesh_bad.json)

# Virtual stages on stage meshes (ZBV, four layers): {0, 1} (tp = 2) runs
# virtual stages 1 and 2, whose boundary is resharded inside the group.
set(xmesh_v "{\"model\": \"mlp\", \"mesh\": [{\"name\": \"world\", \"size\": 3}],
  \"values\": {\"fc2.w\": {\"dims\": [null, \"tp\"]}, \"fc2.b\": {\"dims\": [\"tp\"]},
             \"fc3.w\": {\"dims\": [\"tp\"]}},
  \"stages\": [
    {\"layers\": [\"fc1\"], \"ranks\": [2], \"mesh\": []},
    {\"layers\": [\"fc2\"], \"ranks\": [0, 1], \"mesh\": [{\"name\": \"tp\", \"size\": 2}]},
    {\"layers\": [\"fc3\"], \"ranks\": [0, 1], \"mesh\": [{\"name\": \"tp\", \"size\": 2}]},
    {\"layers\": [\"head\"], \"ranks\": [2], \"mesh\": []}],
  \"microbatches\": 4, \"virtual_stages\": 2, \"schedule\": \"zbv\"}")
file(WRITE ${dir}/xmesh_v.json "${xmesh_v}")
run(0 "stages: 2 physical x 2 virtual.*boundary stage 1 -> 2: relu_5 \\[32, 48\\] f32 \\(inside ranks 0,1\\).*forward per micro-batch: 6144 B in all \\(0:3072 1:3072\\).*rank 0 \\(mesh rank 0 of tp=2\\): virtual stages 1, 2.*stage 2 \\(fc3\\): fc3.w \\[48, 32\\] -> \\[0:24, 0:32\\] over tp"
  "" inspect ${mlp} --set "model.hidden=[64, 48, 32]" --set dist.nproc=3 --plan ${dir}/xmesh_v.json)
run(0 "steps 2  final loss" "" train ${mlp} ${quick} --set "model.hidden=[64, 48, 32]" --nproc 3
  --plan ${dir}/xmesh_v.json)

# Bad plans, each before any step, naming the key and what was expected.
run(1 "" "error: parallel: mesh: mesh dp=2 has 2 devices but the job has 1 rank .*--nproc 2"
  train ${mlp} ${quick} --set parallel.dp=2)
run(1 "" "error: --plan ${dir}/dp.json and the config's \\[parallel\\] section both describe the plan"
  train ${mlp} ${quick} --set parallel.dp=1 --plan ${dir}/dp.json)
run(1 "" "error: tensor wte: dimension 0 \\(size 256\\) is split evenly over axis tp of size 3, which does not divide it \\(expected a multiple of 3, or ratios for an uneven split\\)"
  inspect ${gpt} --set dist.nproc=3 --set parallel.tp=3)
file(WRITE ${dir}/typo.json "{\"mesh\": [{\"name\": \"dp\", \"size\": 1}], \"values\": {\"fc1.wt\": {}}}")
run(1 "" "error: plan ${dir}/typo.json: values.fc1.wt: the model's graph has no value of that name \\(did you mean 'fc1.w'\\?\\)"
  train ${mlp} ${quick} --plan ${dir}/typo.json)
file(WRITE ${dir}/empty_stage.json "{\"mesh\": [{\"name\": \"pp\", \"size\": 2}], \"microbatches\": 2, \"stages\": [{\"layers\": [\"fc1\", \"fc2\", \"head\"]}, {\"layers\": []}]}")
run(1 "" "error: plan ${dir}/empty_stage.json: stages\\[1\\]: stage 1 has no layers"
  train ${mlp} ${quick} --nproc 2 --plan ${dir}/empty_stage.json)
run(1 "" "error: parallel.microbatches: schedule 1f1b with 2 stages needs at least 2 micro-batches \\(one per stage to fill the pipeline\\), got 1"
  inspect ${mlp} --set dist.nproc=2 --set parallel.pp=2)
run(1 "" "error: parallel.tp_ratios: 3 ratios \\[2, 1, 1\\] for tp = 2 \\(expected 2, one per tp rank\\)"
  inspect ${mlp} --set dist.nproc=2 --set parallel.tp=2 "--set" "parallel.tp_ratios=[2,1,1]")
run(1 "" "error: --plan /nonexistent/plan.json: cannot read the plan file"
  inspect ${mlp} --plan /nonexistent/plan.json)
