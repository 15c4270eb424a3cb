// train_recall: trains a tiny transformer from scratch on two-hop associative recall
// (recall_task.hpp) twice, with multi-head attention and with DCMHA: the one switch
// ModelConfig::compose; same seed, same training sequences, same steps, same everything else.
//
//   train_recall [--steps N] [--batch N] [--symbols S] [--pairs N] [--lr X] [--seed N] [--out DIR]
//       the full run: prints progress and the held-out accuracies, writes DIR/train_curves.csv
//       and, through gnuplot, DIR/loss.png (script DIR/loss.gp)
//   train_recall --test
//       the model's backward against finite differences, then a short run of both models whose
//       loss must fall (CTest: train_example)
//
// Exit status: 0 on success, 1 when a check fails or an error occurs, 2 on bad usage.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam.hpp"
#include "grad_check.hpp"
#include "model.hpp"
#include "recall_task.hpp"

namespace {

using dcmha::index_t;

struct RunConfig {
  recall::TaskConfig task;
  train::ModelConfig model;  // compose is set per run
  train::AdamConfig adam;
  index_t batch = 32, steps = 4000;
  index_t log_every = 50;         // one record (mean training loss, accuracy) per interval
  index_t eval_sequences = 1024;  // the held-out set; 0: none
  index_t print_every = 0;        // progress lines; 0: none
  unsigned seed = 1;
};

/// One model's training record, one entry per log interval.
struct Curve {
  std::vector<index_t> steps;
  std::vector<double> loss;      // mean training loss over the interval ending at steps[i]
  std::vector<double> accuracy;  // held-out accuracy after steps[i]
  double seconds = 0.0;          // wall time of training and evaluation
};

/// The command line; the full run's defaults.
struct Options {
  bool test = false;
  index_t steps = 4000, batch = 32, symbols = 32, pairs = 12;
  double lr = 2e-3;
  unsigned seed = 1;
  std::string out = ".";
};

train::ModelConfig model_for(const recall::TaskConfig& task, index_t E, index_t H, index_t D) {
  train::ModelConfig m;
  m.vocab = task.vocab();
  m.classes = task.symbols;
  m.E = E;
  m.H = H;
  m.D = D;
  m.layers = 2;  // two hops, two layers: one lookup each
  return m;
}

RunConfig full_config(const Options& o) {
  RunConfig rc;
  rc.task.symbols = o.symbols;
  rc.task.pairs = o.pairs;
  rc.model = model_for(rc.task, 64, 4, 16);
  rc.batch = o.batch;
  rc.steps = o.steps;
  rc.adam.lr = o.lr;
  rc.adam.warmup = std::min<index_t>(200, o.steps / 10);
  rc.adam.total_steps = o.steps;
  rc.print_every = 500;
  rc.seed = o.seed;
  return rc;
}

/// Small and short: a CTest test of a few seconds.
RunConfig test_config() {
  RunConfig rc;
  rc.task.symbols = 16;
  rc.task.pairs = 6;
  rc.model = model_for(rc.task, 32, 4, 8);
  // One thread: CTest runs tests side by side, and an OpenMP team on busy cores mostly waits.
  rc.model.num_threads = 1;
  rc.batch = 16;
  rc.steps = 60;
  rc.adam.lr = 3e-3;
  rc.adam.warmup = 10;
  rc.adam.total_steps = rc.steps;
  rc.log_every = 1;
  rc.eval_sequences = 0;
  return rc;
}

/// Fresh sequences from a seed of their own, never trained on (beyond chance).
std::vector<recall::Batch> held_out_set(const RunConfig& rc) {
  std::mt19937 rng(rc.seed + 1000);
  const index_t per_batch = 128;
  std::vector<recall::Batch> set;
  for (index_t n = 0; n < rc.eval_sequences; n += per_batch)
    set.push_back(recall::make_batch(rc.task, std::min(per_batch, rc.eval_sequences - n), rng));
  return set;
}

double accuracy(const train::Model<float>& m, const std::vector<recall::Batch>& set,
                train::Activations<float>& a) {
  index_t correct = 0, total = 0;
  for (const recall::Batch& b : set) {
    correct += train::forward(m, b, a).correct;
    total += b.B;
  }
  return total > 0 ? double(correct) / double(total) : 0.0;
}

const char* model_name(bool compose) { return compose ? "DCMHA" : "MHA"; }

Curve train_model(const RunConfig& rc, bool compose, const std::vector<recall::Batch>& held_out) {
  train::ModelConfig mc = rc.model;
  mc.compose = compose;
  train::Model<float> model = train::make_model<float>(mc, rc.task.length(), rc.seed);
  train::Adam<float> opt(rc.adam, train::parameters(model));
  std::mt19937 data(rc.seed + 100);         // the same training sequences for both models
  train::Activations<float> act, eval_act;  // two batch shapes: each keeps its buffers
  Curve curve;
  const auto start = std::chrono::steady_clock::now();
  double interval_loss = 0.0;
  for (index_t step = 1; step <= rc.steps; ++step) {
    const recall::Batch batch = recall::make_batch(rc.task, rc.batch, data);
    interval_loss += train::forward(model, batch, act).loss;
    train::backward(model, batch, act);
    train::adam_step(opt);
    if (step % rc.log_every != 0) continue;
    curve.steps.push_back(step);
    curve.loss.push_back(interval_loss / double(rc.log_every));
    curve.accuracy.push_back(accuracy(model, held_out, eval_act));
    interval_loss = 0.0;
    if (rc.print_every > 0 && step % rc.print_every == 0) {
      std::printf("  %-5s step %5lld  loss %.3f  held-out accuracy %.3f\n", model_name(compose),
                  static_cast<long long>(step), curve.loss.back(), curve.accuracy.back());
      std::fflush(stdout);  // progress, also through a pipe
    }
  }
  curve.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return curve;
}

void write_csv(const std::string& path, const Curve& mha, const Curve& dcmha) {
  std::ofstream f(path);
  f << "step,mha_loss,dcmha_loss,mha_eval_accuracy,dcmha_eval_accuracy\n";
  for (std::size_t i = 0; i < mha.steps.size(); ++i)
    f << mha.steps[i] << ',' << mha.loss[i] << ',' << dcmha.loss[i] << ',' << mha.accuracy[i] << ','
      << dcmha.accuracy[i] << '\n';
  if (!f) throw std::runtime_error("cannot write " + path);
}

/// Writes the gnuplot script beside the CSV and runs it; false when gnuplot fails or is absent.
bool plot(const std::string& dir, const RunConfig& rc) {
  const std::string csv = dir + "/train_curves.csv", script = dir + "/loss.gp";
  std::ofstream f(script);
  f << "set terminal pngcairo size 1100,450 font 'sans,10'\n"
    << "set output '" << dir << "/loss.png'\n"
    << "set datafile separator ','\n"
    << "set key autotitle columnhead\n"  // the CSV's first row is its header
    << "set grid\n"
    << "set multiplot layout 1,2 title 'Two-hop associative recall: S = " << rc.task.symbols
    << " symbols, N = " << rc.task.pairs << " pairs; " << rc.model.layers
    << " layers, E = " << rc.model.E << ", H = " << rc.model.H << ", D = " << rc.model.D
    << "; batch " << rc.batch << "'\n"
    << "set xlabel 'training step'\n"
    << "set ylabel 'training loss (cross-entropy, mean over " << rc.log_every << " steps)'\n"
    << "plot '" << csv << "' using 1:2 with lines lw 2 title 'MHA', '' using 1:3 with lines lw 2 "
    << "title 'DCMHA'\n"
    << "set ylabel 'held-out accuracy (" << rc.eval_sequences << " sequences)'\n"
    << "set yrange [0:1]\nset key left top Left reverse\n"
    << "plot '" << csv << "' using 1:4 with lines lw 2 title 'MHA', '' using 1:5 with lines lw 2 "
    << "title 'DCMHA'\n"
    << "unset multiplot\n";
  f.close();
  const std::string command = "gnuplot '" + script + "'";
  return f && std::system(command.c_str()) == 0;
}

/// The first logged step with held-out accuracy >= `level`; -1: never.
index_t first_step_reaching(const Curve& c, double level) {
  for (std::size_t i = 0; i < c.accuracy.size(); ++i)
    if (c.accuracy[i] >= level) return c.steps[i];
  return -1;
}

int run_full(const RunConfig& rc, const std::string& out_dir) {
  std::printf(
      "two-hop recall: S %lld, N %lld pairs, T %lld; %lld layers, E %lld, H %lld, D %lld; "
      "batch %lld, %lld steps, seed %u\n",
      static_cast<long long>(rc.task.symbols), static_cast<long long>(rc.task.pairs),
      static_cast<long long>(rc.task.length()), static_cast<long long>(rc.model.layers),
      static_cast<long long>(rc.model.E), static_cast<long long>(rc.model.H),
      static_cast<long long>(rc.model.D), static_cast<long long>(rc.batch),
      static_cast<long long>(rc.steps), rc.seed);
  std::filesystem::create_directories(out_dir);
  const std::vector<recall::Batch> held_out = held_out_set(rc);
  const Curve mha = train_model(rc, false, held_out);
  const Curve dcmha = train_model(rc, true, held_out);
  write_csv(out_dir + "/train_curves.csv", mha, dcmha);
  const bool plotted = plot(out_dir, rc);
  std::printf("final held-out accuracy (%lld sequences; chance ~%.3f):\n",
              static_cast<long long>(rc.eval_sequences), 1.0 / double(rc.task.pairs));
  for (const Curve* c : {&mha, &dcmha})
    std::printf("  %-5s %.3f  (final training loss %.3f; accuracy >= 0.9 from step %lld; %.1f s)\n",
                model_name(c == &dcmha), c->accuracy.empty() ? 0.0 : c->accuracy.back(),
                c->loss.empty() ? 0.0 : c->loss.back(),
                static_cast<long long>(first_step_reaching(*c, 0.9)), c->seconds);
  std::printf("wrote %s/train_curves.csv\n", out_dir.c_str());
  if (plotted)
    std::printf("wrote %s/loss.png\n", out_dir.c_str());
  else
    std::printf("no plot: gnuplot %s/loss.gp failed (is gnuplot installed?)\n", out_dir.c_str());
  return 0;
}

bool gradients_pass() {
  const double tolerance = 1e-6;
  bool ok = true;
  std::printf(
      "backward vs central differences (double), max|analytic - numeric| / "
      "max|numeric|, tolerance %.0e:\n",
      tolerance);
  for (const bool compose : {false, true})
    for (const train::GradError& e : train::check_gradients(compose)) {
      const bool good = e.error < tolerance;  // also false for NaN
      std::printf("  %-5s %-13s %.1e%s\n", model_name(compose), e.name.c_str(), e.error,
                  good ? "" : "  FAIL");
      ok = ok && good;
    }
  return ok;
}

/// The mean loss of the last steps must be clearly below the first step's.
bool loss_falls(const Curve& c, bool compose) {
  const std::size_t last = std::min<std::size_t>(10, c.loss.size());
  double mean = 0.0;
  for (std::size_t i = c.loss.size() - last; i < c.loss.size(); ++i) mean += c.loss[i];
  mean /= double(last);
  const double bound = 0.8 * c.loss.front();
  const bool ok = mean < bound;
  std::printf("  %-5s first step %.3f, mean of the last %zu steps %.3f (must be < %.3f)%s\n",
              model_name(compose), c.loss.front(), last, mean, bound, ok ? "" : "  FAIL");
  return ok;
}

int run_test() {
  bool ok = gradients_pass();
  const RunConfig rc = test_config();
  std::printf("training loss, %lld steps of batch %lld:\n", static_cast<long long>(rc.steps),
              static_cast<long long>(rc.batch));
  for (const bool compose : {false, true})
    ok = loss_falls(train_model(rc, compose, {}), compose) && ok;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

/// Reads one option's value into `o`; false for an unknown option.
bool parse_value(const std::string& arg, const char* value, Options& o) {
  if (arg == "--steps")
    o.steps = std::atoll(value);
  else if (arg == "--batch")
    o.batch = std::atoll(value);
  else if (arg == "--symbols")
    o.symbols = std::atoll(value);
  else if (arg == "--pairs")
    o.pairs = std::atoll(value);
  else if (arg == "--lr")
    o.lr = std::atof(value);
  else if (arg == "--seed")
    o.seed = static_cast<unsigned>(std::atoll(value));
  else if (arg == "--out")
    o.out = value;
  else
    return false;
  return true;
}

/// False on bad usage.
bool parse_options(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--test")
      o.test = true;
    else if (i + 1 >= argc || !parse_value(arg, argv[++i], o))
      return false;
  }
  return o.steps > 0 && o.batch > 0 && o.pairs > 0 && o.pairs <= o.symbols && o.lr > 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: %s [--steps N] [--batch N] [--symbols S] [--pairs N (<= S)] "
                 "[--lr X] [--seed N] "
                 "[--out DIR] | --test\n",
                 argv[0]);
    return 2;
  }
  try {
    return o.test ? run_test() : run_full(full_config(o), o.out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_recall: %s\n", e.what());
    return 1;
  }
}
