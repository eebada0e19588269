/* test_model_state.cpp — estimate_memory's model state (csrc/engine/model_state.h) row by row:
 * a plan and the options in, the device, host and buffer bytes out; and smallest_world,
 * stage="auto"'s search. No torch, so it builds here beside the C core's tests.
 * Run: make -C csrc/core test (under AddressSanitizer + UBSan). */
#include "engine/model_state.h"

#include <stdexcept>
#include <tuple>
#include <vector>

#include "check.h"

using namespace zx;

namespace {

void model_state() {
    struct Row {
        int line;
        std::vector<int64_t> group, padded, shard;
        ModelStateInputs in;  // stage world ps rs state_bytes states fused adam pq gq offload a2a remainder gpu sib
        ModelState want;      // params grads master states offloaded host: master states grads ring scratch landing
    };
    // three buckets at N = 4 (padded 224, shard 56, the largest 128 / 32, 7 bytes of tie bits) and at N = 1
    const std::vector<int64_t> g001{0, 0, 1}, g005{0, 0, 5}, p3{64, 128, 32}, s3{16, 32, 8};
    const std::vector<int64_t> adam{2, 1};
    const std::vector<Row> rows = {
        // stage 2, fp32, fused: each state over the whole shard, the groups' most
        {__LINE__, g001, p3, s3, {2, 4, 4, 4, 4, adam, true, true}, {896, 224, 0, 448}},
        // a torch optimizer: each bucket's slice by its group; a group past the list counts as the last
        {__LINE__, g001, p3, s3, {2, 4, 4, 4, 4, adam, false, true}, {896, 224, 0, 416}},
        {__LINE__, g005, p3, s3, {2, 4, 4, 4, 4, adam, false, true}, {896, 224, 0, 416}},
        // bf16 with the split master: 2 bytes and a bit; one pass for Adam's fp32 states, else a GPU scratch
        {__LINE__, g001, p3, s3, {2, 4, 2, 2, 4, adam, true, true, false, false, false, false, true, true},
         {448, 112, 119, 448}},
        {__LINE__, g001, p3, s3, {2, 4, 2, 2, 2, adam, true, true, false, false, false, false, true, true},
         {448, 112, 119, 224, false, 0, 0, 0, 0, 128}},
        {__LINE__, g001, p3, s3, {2, 4, 2, 2, 2, adam, true, true, false, false, false, false, true, false},
         {448, 112, 119, 224}},
        // the scratch: at least 8 and at most 2^24 fp32 elements
        {__LINE__, {0}, {4}, {1}, {2, 4, 2, 2, 2, adam, true, true, false, false, false, false, true, true},
         {8, 2, 3, 4, false, 0, 0, 0, 0, 32}},
        {__LINE__, {0}, {1 << 27}, {1 << 25},
         {2, 4, 2, 2, 4, adam, true, false, false, false, false, false, true, true},
         {1 << 28, 1 << 26, (1 << 26) + (1 << 22), 1 << 28, false, 0, 0, 0, 0, 4 << 24}},
        // stage 3: the fp32 shard is the parameter; with bf16 only the master shard
        {__LINE__, g001, p3, s3, {3, 4, 2, 2, 4, adam, true, true}, {0, 112, 224, 448}},
        {__LINE__, g001, p3, s3, {3, 4, 4, 4, 4, adam, true, true}, {224, 224, 0, 448}},
        // param_quant in stages 1-2: a master shard of its own, none at N = 1
        {__LINE__, g001, p3, s3, {1, 4, 4, 4, 4, adam, true, true, true}, {896, 896, 224, 448}},
        {__LINE__, g001, p3, p3, {1, 1, 4, 4, 4, adam, true, true, true}, {896, 896, 0, 1792}},
        // stage 0: one partition, every bucket whole
        {__LINE__, g001, p3, p3, {0, 4, 4, 4, 4, adam, true, true}, {896, 896, 0, 1792}},
        // offload: master, states, gradient shard and two pinned rings on the host
        {__LINE__, g001, p3, s3, {2, 4, 4, 4, 4, adam, true, true, false, false, true, true},
         {896, 0, 0, 0, true, 224, 448, 224, 1280}},
        {__LINE__, g001, p3, s3, {3, 4, 2, 2, 4, adam, true, true, false, false, true, false},
         {112, 0, 0, 0, true, 224, 448, 112, 256}},
        {__LINE__, g001, p3, s3, {1, 4, 4, 4, 4, adam, true, true, false, false, true, false},
         {896, 896, 0, 0, true, 224, 448, 224, 512}},
        // step in backward: no gradient shard; the all-to-all (or grad_quant) lands a slice
        {__LINE__, g001, p3, s3, {2, 4, 4, 4, 4, adam, true, true, false, false, false, true, false, false, true},
         {896, 0, 0, 448, false, 0, 0, 0, 0, 0, 128}},
        {__LINE__, g001, p3, s3, {2, 4, 4, 4, 4, adam, true, true, false, false, false, false, false, false, true},
         {896, 0, 0, 448}},
        {__LINE__, g001, p3, s3, {2, 4, 4, 4, 4, adam, true, true, false, true, false, false, false, false, true},
         {896, 0, 0, 448, false, 0, 0, 0, 0, 0, 128}},
        {__LINE__, g001, p3, s3, {1, 4, 4, 4, 4, adam, true, true, false, false, false, true, false, false, true},
         {896, 896, 0, 448}},
    };
    for (const Row &r : rows) {
        const ModelState m = model_state_bytes(r.group, r.padded, r.shard, r.in), &w = r.want;
        CHECK(m.parameters == w.parameters && m.gradients == w.gradients && m.master_weights == w.master_weights &&
                  m.optimizer_states == w.optimizer_states,
              "row at line %d: parameters %lld gradients %lld master %lld states %lld", r.line,
              (long long)m.parameters, (long long)m.gradients, (long long)m.master_weights,
              (long long)m.optimizer_states);
        CHECK(m.offloaded == w.offloaded && m.host_master == w.host_master && m.host_states == w.host_states &&
                  m.host_gradients == w.host_gradients && m.pinned_ring == w.pinned_ring,
              "row at line %d: host master %lld states %lld gradients %lld ring %lld", r.line,
              (long long)m.host_master, (long long)m.host_states, (long long)m.host_gradients,
              (long long)m.pinned_ring);
        CHECK(m.split_scratch == w.split_scratch && m.grad_landing == w.grad_landing,
              "row at line %d: scratch %lld landing %lld", r.line, (long long)m.split_scratch,
              (long long)m.grad_landing);
    }
    int threw = 0;
    for (const auto &[group, padded, states] :
         std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>>{
             {{0}, {1, 2}, {1}}, {{0}, {1}, {}}, {{-1}, {1}, {1}}}) {
        try {
            model_state_bytes(group, padded, {1}, {2, 2, 4, 4, 4, states});
        } catch (const std::invalid_argument &) {
            threw++;
        }
    }
    CHECK(threw == 3, "a bucket's counts or the states missing, a group < 0: an exception (%d of 3)", threw);
}

void search() {
    std::vector<int64_t> asked;
    auto from = [&asked](int64_t k) {
        return [&asked, k](int64_t n) { return asked.push_back(n), n >= k; };
    };
    CHECK(smallest_world(1, 1 << 24, from(5)) == 5, "doubling to 8, bisecting to 5");
    CHECK(asked == (std::vector<int64_t>{2, 4, 8, 6, 5}), "asked %zu sizes", asked.size());
    asked.clear();
    CHECK(smallest_world(3, 1 << 24, from(3)) == 4, "world itself is taken as not fitting");
    CHECK(asked == (std::vector<int64_t>{6, 4}), "asked %zu sizes", asked.size());
    CHECK(smallest_world(1, 2, from(3)) == 0, "none up to max_world");
    CHECK(smallest_world(1, 1 << 24, [](int64_t) { return false; }) == 0, "none at all");
    int threw = 0;
    for (const int64_t world : {int64_t(0), int64_t(1) << 62}) {
        try {
            smallest_world(world, 8, from(1));
        } catch (const std::invalid_argument &) {
            threw++;
        }
    }
    try {
        smallest_world(1, 8, [](int64_t) -> bool { throw std::runtime_error("from fits"); });
    } catch (const std::runtime_error &) {
        threw++;
    }
    CHECK(threw == 3, "world 0, world 2^62 and an exception from fits: raised (%d of 3)", threw);
}

}  // namespace

int main() {
    model_state();
    search();
    printf("test_model_state: %ld checks passed, %ld failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
