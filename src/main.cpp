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

  CLI::App* inspect = app.add_subcommand("inspect", "print the model graph and its costs");
  add_common(inspect);

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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  try {
    if (train->parsed()) return mt::cmd_train(opts, argc, argv);
    if (inspect->parsed()) return mt::cmd_inspect(opts);
    if (exp->parsed()) return mt::cmd_export(opts);
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
