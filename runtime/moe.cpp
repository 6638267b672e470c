#include "tandem/moe.h"

#include <algorithm>
#include <cmath>

#include "expert_core.h"
#include "tandem/error.h"

namespace tandem {

MoeLayer::MoeLayer(Pool& pool, MoeShape shape, PackOptions format, int layer_index)
    : pool_(pool), shape_(shape), format_(format), layer_(layer_index), kt_(&kernel_table(effective_isa())),
      scratch_(core::pool_shared<core::ForwardScratch>(pool)) {
  TANDEM_CHECK(shape.experts >= 1 && shape.hidden >= 1 && shape.inter >= 1, Errc::invalid_argument, "moe: shape (experts ",
               shape.experts, ", hidden ", shape.hidden, ", intermediate ", shape.inter, ") must be positive");
  check_gate_act(str_cat("moe: layer ", layer_index), shape.act);
  if (format.format == WeightFormat::int4 && (shape.hidden % format.group || shape.inter % format.group)) {
    std::string fits;  // the groups that would (gpt-oss's 2880 takes 32 and 64, not 128)
    for (const int g : {32, 64, 128})
      if (shape.hidden % g == 0 && shape.inter % g == 0) fits += (fits.empty() ? "" : " or ") + std::to_string(g);
    TANDEM_FAIL(Errc::invalid_argument, "moe: int4 group ", format.group, " must divide hidden (", shape.hidden,
                ") and intermediate (", shape.inter, ")",
                fits.empty() ? std::string("; no int4 group does: use int8 or bf16")
                             : "; set cpu.group_size to " + fits);
  }
  packs_ = std::make_unique<core::ExpertPacks>(shape, format, pool.subpools(), core::ExpertPacks::Layout::fused, layer_index);
}

MoeLayer::~MoeLayer() = default;

std::pair<int, int> MoeLayer::slice(int subpool) const { return packs_->slice(subpool); }
size_t MoeLayer::packed_bytes() const { return packs_->bytes(); }
const PackedWeight& MoeLayer::gate_up_pack(int subpool, int expert) const { return packs_->gate_up(subpool, expert); }
const PackedWeight& MoeLayer::down_pack(int subpool, int expert) const { return packs_->down(subpool, expert); }

ExpertWeights MoeLayer::dequantized(int e) const {
  TANDEM_CHECK(loaded_, Errc::invalid_argument, "moe: layer ", layer_, ": dequantized() before load()");
  TANDEM_CHECK(e >= 0 && e < shape_.experts && !excluded(e), Errc::invalid_argument, "moe: layer ", layer_, ": expert ", e,
               e >= 0 && e < shape_.experts ? " is not held here" : " is out of range");
  const size_t H = shape_.hidden, I = shape_.inter;
  ExpertWeights w;
  w.gate.assign(I * H, 0.0f);
  w.up.assign(I * H, 0.0f);
  w.down.assign(H * I, 0.0f);
  for (int s = 0; s < pool_.subpools(); ++s) {
    const auto [i0, i1] = slice(s);
    const size_t len = i1 - i0;
    if (!len) continue;
    const std::vector<float> gu = unpack(gate_up_pack(s, e)), dn = unpack(down_pack(s, e));  // [2 len x H], [H x len]
    std::copy(gu.begin(), gu.begin() + len * H, w.gate.begin() + i0 * H);
    std::copy(gu.begin() + len * H, gu.begin() + 2 * len * H, w.up.begin() + i0 * H);
    for (size_t r = 0; r < H; ++r) std::copy(&dn[r * len], &dn[r * len] + len, &w.down[r * I + i0]);
  }
  return w;
}

void MoeLayer::exclude(const std::vector<int>& experts) {
  TANDEM_CHECK(!loaded_, Errc::invalid_argument, "moe: layer ", layer_, ": exclude() after load()");
  excluded_.assign(shape_.experts, 0);
  for (int e : experts) {
    TANDEM_CHECK(e >= 0 && e < shape_.experts, Errc::invalid_argument, "moe: layer ", layer_, ": excluded expert ", e,
                 " is outside [0, ", shape_.experts, ")");
    excluded_[e] = 1;
  }
  packs_->set_skipped(excluded_);
}

int intermediate_unit(const PackOptions& format) {
  return format.format == WeightFormat::int4 ? std::max(kPanel, format.group) : kPanel;
}

std::vector<int> intermediate_slices(int inter, int subpools, const PackOptions& format) {
  const int unit = intermediate_unit(format);
  const int units = (inter + unit - 1) / unit;
  std::vector<int> slices(subpools + 1);
  for (int s = 0; s <= subpools; ++s)
    slices[s] = std::min(inter, static_cast<int>(static_cast<int64_t>(units) * s / subpools) * unit);
  return slices;
}

void MoeLayer::load(const std::function<ExpertSource(int)>& source, const Progress& progress) {
  TANDEM_CHECK(static_cast<bool>(source), Errc::invalid_argument, "moe: load without a weight source");
  packs_->load(pool_, source, progress);
  loaded_ = true;
}

void MoeLayer::load(const ExpertStore& store, int index, const Progress& progress) {
  const StoreSpec& s = store.spec();
  TANDEM_CHECK(s.shape.experts == shape_.experts && s.shape.hidden == shape_.hidden && s.shape.inter == shape_.inter &&
                   same_packing(s.format, format_),
               Errc::invalid_argument, "moe: layer ", layer_, ": store ", store.dir().string(),
               " holds other experts (check the store against the model first: ExpertStore::check)");
  packs_->load_store(pool_, store, index, progress);
  loaded_ = true;
}

void MoeLayer::unload() {
  packs_->drop();
  loaded_ = false;
}

void MoeLayer::load(const Checkpoint& ckpt, int layer, const ExpertNaming& naming, const Progress& progress) {
  load(packs_->checkpoint_source(ckpt, layer, naming), progress);
}

TokenGroups group_tokens(const MoeInput& in, int experts, int layer, const std::vector<uint8_t>& excluded) {
  TANDEM_CHECK(in.tokens >= 0, Errc::invalid_argument, "moe: tokens = ", in.tokens, " is negative");
  TokenGroups g;
  if (in.tokens == 0) return g;
  TANDEM_CHECK((in.x != nullptr) != (in.x_f32 != nullptr), Errc::invalid_argument,
               "moe: give exactly one input (bf16 x or fp32 x_f32)");
  TANDEM_CHECK((in.ids != nullptr) != (in.ids_i64 != nullptr), Errc::invalid_argument,
               "moe: give exactly one of topk_ids (int32) and topk_ids_i64");
  TANDEM_CHECK(in.weights != nullptr, Errc::invalid_argument, "moe: topk_weights is null");
  TANDEM_CHECK(in.out != nullptr, Errc::invalid_argument, "moe: output is null");
  TANDEM_CHECK(in.top_k >= 1, Errc::invalid_argument, "moe: top_k = ", in.top_k, " must be at least 1");
  const int E = experts, K = in.top_k, T = in.tokens;
  auto is_excluded = [&](int64_t e) { return !excluded.empty() && excluded[e]; };
  std::vector<int> per_expert(E, 0);
  g.slot_row.assign(static_cast<size_t>(T) * K, -1);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(t) * K + k;
      const int64_t id = in.ids ? in.ids[i] : in.ids_i64[i];
      TANDEM_CHECK(id >= -1 && id < E, Errc::invalid_argument, "moe: topk_ids[", t, ", ", k, "] = ", id,
                   " is outside [-1, ", E, ")");
      TANDEM_CHECK(std::isfinite(in.weights[i]), Errc::invalid_argument, "moe: topk_weights[", t, ", ", k, "] = ",
                   in.weights[i], " is not finite");
      if (id < 0 || (in.expert_mask && !in.expert_mask[id])) continue;
      if (layer < 0)
        TANDEM_CHECK(!is_excluded(id), Errc::invalid_argument, "experts: ids[", t, ", ", k, "] = ", id,
                     ": these experts do not hold that one");
      else
        TANDEM_CHECK(!is_excluded(id), Errc::invalid_argument, "moe: topk_ids[", t, ", ", k, "] = ", id, ": layer ",
                     layer, " does not hold that expert on the CPU (excluded: it is placed elsewhere)");
      ++per_expert[id];
    }
  // Group rows per expert (experts ascending, tokens in order within each).
  std::vector<int> first(E, -1);
  for (int e = 0; e < E; ++e)
    if (per_expert[e]) {
      first[e] = g.total_rows;
      g.active.push_back(e);
      g.count.push_back(per_expert[e]);
      g.offset.push_back(g.total_rows);
      g.total_rows += per_expert[e];
    }
  g.rows_token.resize(g.total_rows);
  std::vector<int> fill(E, 0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(t) * K + k;
      const int64_t id = in.ids ? in.ids[i] : in.ids_i64[i];
      if (id < 0 || (in.expert_mask && !in.expert_mask[id])) continue;
      const int row = first[id] + fill[id]++;
      g.rows_token[row] = t;
      g.slot_row[i] = row;
    }
  return g;
}

std::shared_ptr<Task> MoeLayer::task_for(const MoeInput& in) {
  TANDEM_CHECK(loaded_, Errc::invalid_argument, "moe: layer ", layer_, " has no weights (call load first)");
  TokenGroups groups = group_tokens(in, shape_.experts, layer_, excluded_);
  if (in.tokens == 0) return nullptr;
  std::vector<int> threads(pool_.subpools());
  for (int s = 0; s < pool_.subpools(); ++s) threads[s] = pool_.threads(s);
  return std::make_shared<core::ExpertForward>(*packs_, *scratch_, *kt_, std::move(threads), layer_, in,
                                               std::move(groups));
}

uint64_t MoeLayer::submit(const MoeInput& in) {
  auto task = task_for(in);
  return task ? pool_.submit(std::move(task)) : 0;
}

void MoeLayer::forward(const MoeInput& in) {
  auto task = task_for(in);
  if (task)
    pool_.run(std::move(task));
  else
    pool_.sync();
}

}  // namespace tandem
