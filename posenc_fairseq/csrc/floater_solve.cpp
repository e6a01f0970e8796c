// FLOATER's hidden-space Runge-Kutta loops (posenc_fairseq/encodings/floater/solver.py, HiddenSpaceSolve)
// compiled: the same operations as the Python loops `_hidden_forward_loops` / `_hidden_backward_loops`,
// without the interpreter between them, and with the rows of the state split into parts integrated
// side by side on their own threads (the rows are independent ODEs that share h's weights). The
// Python side precomputes the solve's pieces (`_HiddenRun`) and combines the parts' results.
#include <torch/extension.h>

#include <thread>
#include <vector>

using at::Tensor;

namespace {

struct Run {
  Tensor w1b, w1b_t, w2h, w2h_t, m, m_t, bias1, cz, b2_sums, b_repeated;
  std::vector<std::vector<double>> a;
  std::vector<double> b;
  double dt;
  int64_t substeps;
};

// The substeps of one interval from b(t_i) = `state` (count, dim), tracking z = W1_b b: writes every
// stage's relu output into `relus` (substeps, stages, count, hidden) and returns the sum of b_i times
// them (count, hidden). `kz` and `pre` are (stages, count, hidden) scratch.
Tensor interval_forward(const Run& run, int64_t interval, const Tensor& state, const Tensor& relus, Tensor& kz,
                        Tensor& pre) {
  const int64_t stages = static_cast<int64_t>(run.b.size());
  Tensor z = at::mm(state, run.w1b_t);
  Tensor acc = at::zeros_like(z);
  for (int64_t j = 0; j < run.substeps; ++j) {
    const int64_t step = interval * run.substeps + j;
    at::add_out(pre, z.unsqueeze(0), run.bias1[step].unsqueeze(1));  // every stage's z + bias1
    for (int64_t i = 0; i < stages; ++i) {
      Tensor stage_pre = pre[i];
      for (int64_t l = 0; l < i; ++l)
        if (run.a[i][l] != 0.0) stage_pre.add_(kz[l], run.dt * run.a[i][l]);
      Tensor relu = relus[j][i];
      at::clamp_min_out(relu, stage_pre, 0);
      Tensor stage_kz = kz[i];
      at::addmm_out(stage_kz, run.cz[step][i], relu, run.m_t);
      acc.add_(relu, run.b[i]);
    }
    for (int64_t i = 0; i < stages; ++i) z.add_(kz[i], run.dt * run.b[i]);
  }
  return acc;
}

// Forward of one part: states (intervals + 1, count, dim) from y0 (count, dim), and the relu outputs
// (steps, stages, count, hidden) if `keep`.
std::vector<Tensor> forward_part(const Run& run, const Tensor& y0, bool keep) {
  const int64_t intervals = run.b2_sums.size(0), count = y0.size(0), hidden = run.m.size(0);
  const int64_t stages = static_cast<int64_t>(run.b.size());
  Tensor states = at::empty({intervals + 1, count, y0.size(1)}, y0.options());
  states[0].copy_(y0);
  Tensor relus = keep ? at::empty({intervals * run.substeps, stages, count, hidden}, y0.options())
                      : at::empty({run.substeps, stages, count, hidden}, y0.options());
  Tensor kz = at::empty({stages, count, hidden}, y0.options());
  Tensor pre = at::empty({stages, count, hidden}, y0.options());
  for (int64_t interval = 0; interval < intervals; ++interval) {
    Tensor recorded = keep ? relus.narrow(0, interval * run.substeps, run.substeps) : relus;
    Tensor acc = interval_forward(run, interval, states[interval], recorded, kz, pre);
    Tensor next = states[interval + 1];
    at::addmm_out(next, states[interval] + run.b2_sums[interval], acc, run.w2h_t, 1, run.dt);
  }
  if (!keep) return {states};
  return {states, relus};
}

// Backward of one part (the exact discrete adjoint, as `_hidden_backward_loops`): returns
// d loss / d b(t_first), d loss / d bias1 (steps, stages, hidden), the per-interval relu sums,
// d loss / d b(t_i+1), d loss / d z at each interval's start, d loss / d M and d loss / d cz.
std::vector<Tensor> backward_part(const Run& run, const Tensor& states, const Tensor& grad_states,
                                  const c10::optional<Tensor>& kept) {
  const int64_t intervals = states.size(0) - 1, count = states.size(1), dim = states.size(2);
  const int64_t hidden = run.m.size(0), stages = static_cast<int64_t>(run.b.size());
  const int64_t substeps = run.substeps, steps = intervals * substeps;
  const auto options = states.options();
  const bool keep = kept.has_value();
  Tensor relus = keep ? *kept : at::empty({substeps, stages, count, hidden}, options);
  Tensor grad_kz = at::empty({keep ? steps : substeps, stages, count, hidden}, options);
  Tensor grad_pre = at::empty({substeps, stages, count, hidden}, options);
  Tensor grad_bias1 = at::empty({steps, stages, hidden}, options);
  Tensor sums = at::empty({intervals, count, hidden}, options);
  Tensor after = at::empty({intervals, count, dim}, options);
  Tensor starts = at::empty({intervals, count, hidden}, options);
  Tensor grad_m = at::zeros({hidden, hidden}, options);
  Tensor grad_cz = at::empty({steps, stages, hidden}, options);
  Tensor kz = at::empty({stages, count, hidden}, options);
  Tensor pre = at::empty({stages, count, hidden}, options);
  Tensor gy = grad_states[intervals].clone();
  Tensor grad_z = at::empty({count, hidden}, options);
  for (int64_t interval = intervals - 1; interval >= 0; --interval) {
    if (!keep) interval_forward(run, interval, states[interval], relus, kz, pre);
    Tensor interval_relus = keep ? relus.narrow(0, interval * substeps, substeps) : relus;
    Tensor sum_row = sums[interval].view({1, -1});
    at::mm_out(sum_row, run.b_repeated, interval_relus.reshape({substeps * stages, -1}));
    after[interval].copy_(gy);
    // d loss / d relu through b(t_i+1): the same for every stage of the interval (times b_i)
    Tensor through_b = at::mm(gy * run.dt, run.w2h);
    grad_z.zero_();  // z at the interval's end is not used (the next interval starts from b)
    for (int64_t j = substeps - 1; j >= 0; --j) {
      const int64_t step = interval * substeps + j;
      const int64_t row = keep ? step : j;
      Tensor step_grad_pre = grad_pre[j];
      for (int64_t i = stages - 1; i >= 0; --i) {
        Tensor stage_grad_kz = grad_kz[row][i];
        at::mul_out(stage_grad_kz, grad_z, run.dt * run.b[i]);
        for (int64_t l = i + 1; l < stages; ++l)
          if (run.a[l][i] != 0.0) stage_grad_kz.add_(step_grad_pre[l], run.dt * run.a[l][i]);
        Tensor grad_relu = at::addmm(through_b, stage_grad_kz, run.m, run.b[i], 1);
        Tensor stage_grad_pre = step_grad_pre[i];
        at::threshold_backward_out(stage_grad_pre, grad_relu, relus[row][i], 0);
      }
      grad_z.add_(step_grad_pre.sum(0));
    }
    Tensor interval_grad_bias1 = grad_bias1.narrow(0, interval * substeps, substeps);
    at::sum_out(interval_grad_bias1, grad_pre, {2});
    starts[interval].copy_(grad_z);
    // b(t_i) reaches the loss directly, through b(t_i+1) and through z = W1_b b(t_i)
    gy = grad_states[interval] + gy + at::mm(grad_z, run.w1b);
    if (!keep) {
      grad_m.addmm_(grad_kz.reshape({-1, hidden}).t(), relus.reshape({-1, hidden}));
      Tensor interval_grad_cz = grad_cz.narrow(0, interval * substeps, substeps);
      at::sum_out(interval_grad_cz, grad_kz, {2});
    }
  }
  if (keep) {
    grad_m = at::mm(grad_kz.reshape({-1, hidden}).t(), relus.reshape({-1, hidden}));
    at::sum_out(grad_cz, grad_kz, {2});
  }
  return {gy, grad_bias1, sums, after, starts, grad_m, grad_cz};
}

Run make_run(const std::vector<Tensor>& pieces, const std::vector<std::vector<double>>& a,
             const std::vector<double>& b, double dt, int64_t substeps) {
  TORCH_CHECK(pieces.size() == 10, "floater_solve: expected 10 precomputed tensors");
  return Run{pieces[0], pieces[1], pieces[2], pieces[3], pieces[4], pieces[5], pieces[6], pieces[7], pieces[8],
             pieces[9], a, b, dt, substeps};
}

// Runs `work(p)` for every part, part 0 on this thread and the others on their own threads, each
// with one intra-op thread, without autograd recording (grad mode is per thread) and without the GIL.
template <typename Work>
void in_parts(size_t parts, Work work) {
  pybind11::gil_scoped_release no_gil;
  at::NoGradGuard no_grad;
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(parts);
  for (size_t p = 1; p < parts; ++p)
    threads.emplace_back([&, p]() {
      try {
        at::NoGradGuard no_grad_here;
        at::set_num_threads(1);
        work(p);
      } catch (...) {
        errors[p] = std::current_exception();
      }
    });
  try {
    work(0);
  } catch (...) {
    errors[0] = std::current_exception();
  }
  for (auto& thread : threads) thread.join();
  for (auto& error : errors)
    if (error) std::rethrow_exception(error);
}

std::vector<std::vector<Tensor>> forward(const std::vector<Tensor>& pieces, const std::vector<std::vector<double>>& a,
                                         const std::vector<double>& b, double dt, int64_t substeps,
                                         const std::vector<Tensor>& y0_parts, bool keep) {
  const Run run = make_run(pieces, a, b, dt, substeps);
  std::vector<std::vector<Tensor>> results(y0_parts.size());
  in_parts(y0_parts.size(), [&](size_t p) { results[p] = forward_part(run, y0_parts[p], keep); });
  return results;
}

std::vector<std::vector<Tensor>> backward(const std::vector<Tensor>& pieces, const std::vector<std::vector<double>>& a,
                                          const std::vector<double>& b, double dt, int64_t substeps,
                                          const std::vector<Tensor>& state_parts,
                                          const std::vector<Tensor>& grad_parts,
                                          const std::vector<Tensor>& kept_parts) {
  const Run run = make_run(pieces, a, b, dt, substeps);
  std::vector<std::vector<Tensor>> results(state_parts.size());
  in_parts(state_parts.size(), [&](size_t p) {
    c10::optional<Tensor> kept;
    if (!kept_parts.empty()) kept = kept_parts[p];
    results[p] = backward_part(run, state_parts[p], grad_parts[p], kept);
  });
  return results;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("forward", &forward, "FLOATER hidden-space solve, forward loops of the row parts");
  module.def("backward", &backward, "FLOATER hidden-space solve, backward loops of the row parts");
}
