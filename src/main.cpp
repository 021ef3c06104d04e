// meshtrain command-line entry point. Parses the sub-commands, maps the
// config to options (run_config.cpp), and turns library errors into messages
// and exit codes (the only place that does; see docs/errors.md):
// 0 success, 1 mt::Error (bad input, peer failure), 2 usage error,
// 3 internal error; `train` stopped by SIGINT / SIGTERM after writing its
// checkpoint: 128 + the signal (cmd_train).
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "meshtrain/base/error.h"
#include "meshtrain/cli/commands.h"
#include "meshtrain/cli/launch.h"
#include "meshtrain/cli/run_config.h"

int main(int argc, char** argv) {
  CLI::App app{"meshtrain: train deep neural networks on one machine or many"};
  app.require_subcommand(1);
  app.set_version_flag("--version", mt::version_string());

  mt::CommandOptions opts;
  auto add_common = [&](CLI::App* sub) {
    sub->add_option("--config", opts.config_path, "TOML config file (see configs/)")->required();
    sub->add_option("--set", opts.overrides, "override a config value: section.key=value")
        ->take_all();
  };

  CLI::App* train = app.add_subcommand("train", "train a model");
  add_common(train);
  train->add_option("--metrics", opts.metrics_path, "write metrics as JSON lines to this file");
  train->add_option("--nproc", opts.nproc, "number of ranks to start (through mpirun)")
      ->check(CLI::Range(1, mt::kMaxRanks));
  train->add_option("--hosts", opts.hostfile,
                    "Open MPI hostfile: start the --nproc ranks on these machines");
  train->add_option("--trace", opts.trace_path,
                    "write a Chrome-trace JSON timeline of every rank (opens in Perfetto)");
  train->add_option("--tensorboard", opts.tensorboard_dir,
                    "write a TensorBoard event file into this directory (train.tensorboard)");
  train->add_flag("--quiet", opts.quiet, "no progress output");
  train->add_option("--plan", opts.plan_path,
                    "parallel plan JSON (docs/plan.md) instead of the config's [parallel]");
  train->add_option("--write-plan", opts.write_plan_path,
                    "write the expanded parallel plan as JSON to this file");
  train->add_flag("--print-config", opts.print_config,
                  "print the effective configuration (defaults marked) and stop");

  CLI::App* inspect = app.add_subcommand("inspect", "print the model graph and its costs");
  add_common(inspect);
  inspect->add_option("--plan", opts.plan_path,
                      "parallel plan JSON (docs/plan.md): print each rank's part of it");
  inspect->add_option("--write-plan", opts.write_plan_path,
                      "write the expanded parallel plan ([parallel] or --plan) as JSON and stop");
  inspect->add_flag("--print-config", opts.print_config,
                    "print the effective configuration (defaults marked) and stop");

  CLI::App* simulate = app.add_subcommand(
      "simulate", "predict a plan's step time, MFU and memory on a cluster file (simulation)");
  simulate->add_option("--config", opts.config_path, "TOML config file (default: the defaults)");
  simulate->add_option("--set", opts.overrides, "override a config value: section.key=value")
      ->take_all();
  simulate->add_option("--plan", opts.plan_path,
                       "parallel plan JSON (docs/plan.md) instead of the config's [parallel]");
  simulate->add_option("--cluster", opts.cluster_path, "cluster file (docs/cluster.md)")
      ->required();
  simulate->add_option("--trace", opts.trace_path,
                       "write the predicted Chrome-trace timeline (the format of train --trace)");

  CLI::App* config = app.add_subcommand("config", "describe the configuration keys");
  bool list_keys = false, markdown = false;
  config->add_flag("--list", list_keys, "every key with type, default, allowed values, meaning")
      ->required();
  config->add_flag("--markdown", markdown, "as a Markdown table (README.md's key list)");

  CLI::App* exp = app.add_subcommand(
      "export", "write a checkpoint's weights as a PyTorch-layout safetensors file");
  add_common(exp);
  exp->add_option("--checkpoint", opts.export_checkpoint,
                  "checkpoint file or sharded directory (default: train.checkpoint)");
  exp->add_option("--out", opts.export_out, "the .safetensors file to write")->required();
  CLI::Option* logits_for =
      exp->add_option("--logits-for", opts.logits_for,
                      "also write the logits of the first N test examples (to compare with "
                      "PyTorch)")
          ->check(CLI::PositiveNumber);
  exp->add_option("--logits-out", opts.logits_out, "where (default: OUT with .logits)")
      ->needs(logits_for);

  CLI::App* gen = app.add_subcommand(
      "graph-gen", "write the graph that data.* names (generated or read) as a graph file");
  add_common(gen);
  gen->add_option("--out", opts.graph_out, "the graph file to write (docs/graph_format.md)")
      ->required();

  CLI::App* calibrate = app.add_subcommand(
      "calibrate",
      "measure this machine (kernels, memory, collectives) and write its cluster file");
  calibrate
      ->add_option("--nproc", opts.nproc, "ranks to measure the collectives on (1: kernels only)")
      ->check(CLI::Range(1, mt::kMaxRanks));
  calibrate->add_option("--out", opts.calibrate_out, "the cluster file to write (default: stdout)");
  calibrate->add_flag("--quick", opts.calibrate_quick, "small sizes only (seconds; for tests)");
  calibrate->add_flag("--quiet", opts.quiet, "no progress lines");

  CLI::App* plan = app.add_subcommand(
      "plan", "search parallel plans for a model on a cluster file and write the best");
  add_common(plan);
  plan->add_option("--cluster", opts.cluster_path, "cluster file (docs/cluster.md)")->required();
  plan->add_option("--nproc", opts.nproc, "ranks (default: the cluster file's)")
      ->check(CLI::Range(1, 1 << 20));
  plan->add_option("--top", opts.top, "how many plans to print (default 5)")
      ->check(CLI::Range(1, 1000));
  plan->add_option("--out", opts.plan_out, "where the best plan goes (default plan.json)");
  plan->add_option("--threads", opts.plan_threads,
                   "threads pricing plans (default: the machine's; the output does not change)")
      ->check(CLI::Range(1, 1024));
  plan->add_flag("--quiet", opts.quiet, "no progress line");

  if (argc > 1) {
    // CLI11 answers a misspelt command with "A subcommand is required".
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    if (auto msg = mt::unknown_command_message(argv[1], names)) {
      std::fprintf(stderr, "meshtrain: %s\nRun with --help for more information.\n", msg->c_str());
      return 2;
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  try {
    if (train->parsed()) return mt::cmd_train(opts, argc, argv);
    if (inspect->parsed()) return mt::cmd_inspect(opts);
    if (simulate->parsed()) return mt::cmd_simulate(opts);
    if (exp->parsed()) return mt::cmd_export(opts);
    if (config->parsed()) return mt::cmd_config_list(markdown);
    if (gen->parsed()) return mt::cmd_graph_gen(opts);
    if (plan->parsed()) return mt::cmd_plan(opts);
    if (calibrate->parsed()) return mt::cmd_calibrate(opts, argc, argv);
  } catch (const mt::InternalError& e) {
    std::fprintf(stderr, "meshtrain: internal error: %s\n", e.what());
    mt::abort_distributed_job(3);
    return 3;
  } catch (const mt::Error& e) {
    std::fprintf(stderr, "meshtrain: error: %s\n", e.what());
    mt::abort_distributed_job(1);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain: internal error: %s\n", e.what());
    mt::abort_distributed_job(3);
    return 3;
  }
  return 2;
}
