// The pieces of a sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral) in the native step: decoder_step.cpp's
// expert_mlp runs them, for a layer with LayerWeights::experts > 0, instead of the dense gated MLP.
//
// The arithmetic is worker/model/moe.py's: the router's logits over every expert, their softmax in float32,
// the top_k experts of each row, their weights renormalised to sum to 1 where the model says so; each chosen
// expert's gated MLP on the row, the outputs summed by weight in expert order, then added to the residual.
// The router stays float32 here (the torch path keeps it dense for the same reason: a quantized router can
// pick other experts).
//
// Why grouped by expert: the step's (row, expert) pairs are sorted by expert, so each expert's weights are
// read once a step for all the rows that chose it, as a dense linear's are for all rows. The pairs are rows
// of x like any other (Buffers are sized for rows * top_k), each expert's linear runs on its run of pairs,
// and the experts follow one another without a barrier between them (each linear claims its blocks with
// `nowait`, and each writes its own pairs' outputs): a layer costs the dense MLP's barriers, not a set per
// expert.

// Where a step's pairs go: every thread derives the same plan from the routes (no barrier to share it).
struct ExpertPlan {
  std::vector<int64_t> start;     // [experts + 1]: expert e's pairs are [start[e], start[e + 1])
  std::vector<int64_t> pair_row;  // [pairs]: the row each pair's x comes from, by expert then row
  std::vector<float> pair_weight; // [pairs]: its expert's weight for its row
  std::vector<int64_t> row_pair;  // [rows * top_k]: each row's pairs, in expert order

  void build(const int64_t* chosen, const float* weight, int64_t rows, int64_t top_k, int64_t experts) {
    start.assign(experts + 1, 0);
    for (int64_t i = 0; i < rows * top_k; ++i) ++start[chosen[i] + 1];
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    pair_row.resize(rows * top_k);
    pair_weight.resize(rows * top_k);
    row_pair.resize(rows * top_k);
    for (int64_t i = 0; i < rows * top_k; ++i) {
      const int64_t pair = next[chosen[i]]++;
      pair_row[pair] = i / top_k;
      pair_weight[pair] = weight[i];
      row_pair[i] = pair;
    }
    for (int64_t r = 0; r < rows; ++r) std::sort(row_pair.begin() + r * top_k, row_pair.begin() + (r + 1) * top_k);
  }
};

// Rows of x from row `r` on: one expert's run of pairs as its linear's input.
inline QuantizedRows rows_from(const QuantizedRows& x, int64_t r) {
  return QuantizedRows{x.q + r * x.stride, x.scale + r * (x.stride / kGroup), x.sum + r * (x.stride / kGroup), x.stride};
}
inline Int8Rows rows_from(const Int8Rows& x, int64_t r) {
  return Int8Rows{x.q + r * x.stride, x.scale + r * (x.stride / kHalf), x.half_sum + r * (x.stride / kHalf), x.stride};
}

// A row's top_k experts and their weights, from its normalised x.
void route_row(const LayerWeights& w, int64_t hidden, const float* x, int64_t* chosen, float* weight) {
  std::vector<float> logits(w.experts);
  for (int64_t e = 0; e < w.experts; ++e) {
    const float* router = w.router + e * hidden;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(router + i), _mm512_loadu_ps(x + i), acc);
    logits[e] = _mm512_reduce_add_ps(acc);
  }
  const float top = *std::max_element(logits.begin(), logits.end());
  double total = 0;
  for (float& l : logits) total += (l = std::exp(l - top));
  float picked = 0.f;
  for (int64_t k = 0; k < w.top_k; ++k) {  // top_k is small (2 to 8): repeated arg-max, lowest index on ties
    const int64_t best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    chosen[k] = best;
    weight[k] = static_cast<float>(logits[best] / total);
    picked += weight[k];
    logits[best] = -1.f;
  }
  if (w.normalize_top_k)
    for (int64_t k = 0; k < w.top_k; ++k) weight[k] /= picked;
}

// Each expert's linear on its run of pairs: x[pair] -> out[pair] (out_width floats a pair), no barrier
// between experts.
template <typename Rows>
void experts_linear(const QuantMatrix* matrices, const ExpertPlan& plan, int64_t experts, const Rows& x, float* out, int64_t out_width) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = plan.start[e], count = plan.start[e + 1] - first;
    if (count) quant_linear(matrices[e], rows_from(x, first), count, out + first * out_width, false);
  }
}
