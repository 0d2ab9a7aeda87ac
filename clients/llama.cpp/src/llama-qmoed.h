// llama-qmoed.h - the routed experts of llama.cpp's MoE layers served by qmoed.
//
// Part of qmoed (clients/llama.cpp), compiled into libllama by build.sh. The
// model side (llama_qmoed_attach) checks the GGUF against the daemon's bank
// at load and tells the loader which expert tensors it must not load; the
// context side (one session, one shared-memory map and one connection per
// llama_context) replaces each served layer's expert computation with one
// custom ggml op that hands the daemon the layer's input rows and
// llama.cpp's own routing (topk_ids / topk_weights) and takes the weighted
// sum of the experts back from the map.
#pragma once

#include "llama-arch.h"

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_hparams;
struct llama_model_loader;
struct llama_qmoed_params;

// What the loader learnt at load: immutable, shared by the model and its
// contexts.
struct llama_qmoed_model {
    std::string socket;   // the daemon's Unix socket
    std::string name;     // the bank's name in the daemon
    std::string policy, budget, precision, on_miss; // session options; "" = the daemon's default
    std::string bank;     // --qmoed-bank as an absolute path ("" = none): loaded again by a context
                          // whose session comes back to a restarted daemon that lacks the model
    uint64_t bank_bytes = 0;           // the bank's expert bytes (bytes_total), for the log
    uint64_t other_bytes = 0;          // the GGUF's tensors but the expert tensors qmoed serves
    bool weights_mapped = false;       // the loader maps those (set once, after attach)
    uint32_t n_embd = 0;               // hidden size
    uint32_t n_expert_used = 0;        // widest routing (topk_ids columns) of any layer
    std::vector<int32_t> bank_layer;   // per block: the bank layer serving it, -1 for none

    bool serves(int il) const {
        return il >= 0 && (size_t) il < bank_layer.size() && bank_layer[il] >= 0;
    }
};

// Checks the GGUF at `gguf_path` (architecture `arch`, hyperparameters `hp`,
// tensors in `ml`) against the bank the daemon serves under the chosen name,
// loading it with model.load when the daemon lacks it and `p.bank` is given
// (and importing it with `qmoe-bank import gguf` first when that file does
// not exist). On success the served blocks' expert tensors are added to
// `*skip`, which the loader never allocates, reads or prefetches. Throws
// std::runtime_error with one sentence naming what does not match; nothing
// stays loaded in the daemon by this call then.
std::shared_ptr<llama_qmoed_model> llama_qmoed_attach(
        const llama_qmoed_params & p, const std::string & gguf_path, llm_arch arch,
        const llama_hparams & hp, const llama_model_loader & ml, std::set<std::string> * skip);

// One context's session. Opening makes the object the graphs' ops point to,
// before any graph is built; connecting, once the context's buffers are
// allocated, creates the daemon's session (policy, budget, precision,
// on_miss) and a map big enough for `n_ubatch` rows, and throws
// std::runtime_error with the daemon's reason. With budget "auto" it
// declares `compute_bytes` (the context's compute buffers, reserved and not
// yet touched) and `mapped_bytes` (weights the loader maps, not yet read) as
// the client's pending bytes, which the budget leaves free. With `dry_run` (a
// context that only measures memory: its graphs are built, never computed)
// nothing is sent to the daemon. Closing (the deleter) logs the session's counters,
// then closes the map, the session and the connection. Across a daemon
// restart libqmoe-client brings the session and its map back within its
// window ($QMOED_RECONNECT_S, default 30 s) and retries the layer call
// (docs/ENGINES.md "Across a daemon restart"); each step is logged.
struct llama_qmoed_session;
struct llama_qmoed_session_deleter {
    void operator()(llama_qmoed_session * s) const;
};
using llama_qmoed_session_ptr = std::unique_ptr<llama_qmoed_session, llama_qmoed_session_deleter>;

llama_qmoed_session_ptr llama_qmoed_session_open(std::shared_ptr<const llama_qmoed_model> model,
                                                 uint32_t n_ubatch, bool dry_run);
void llama_qmoed_session_connect(llama_qmoed_session * s, uint64_t compute_bytes, uint64_t mapped_bytes);

// Whether block `il`'s routed experts are the daemon's.
bool llama_qmoed_serves(const llama_qmoed_session * s, int il);

// The op that replaces block `il`'s routed experts: `cur` F32 [n_embd, T],
// `selected` I32 [k, T] (the experts llama.cpp chose), `weights` F32
// [1, k, T] (their mixing weights, as llama.cpp applies them). Returns F32
// [n_embd, T] = sum_j weights[j, t] * expert_{selected[j, t]}(cur[:, t]).
// The tensors must live in host memory (the op runs on the CPU backend).
ggml_tensor * llama_qmoed_build_moe(ggml_context * ctx, llama_qmoed_session * s, int il,
                                    ggml_tensor * cur, ggml_tensor * selected, ggml_tensor * weights);

// After a graph ran: false when every layer call of the session succeeded;
// else true with the first failure's sentence in *why (the daemon named),
// and the graph must be failed: once a layer call failed, the later ops of
// that graph only wrote zeros, so nothing it computed may be used. The
// failure is cleared: the next graph's layer calls try the daemon again.
bool llama_qmoed_failed(llama_qmoed_session * s, std::string * why);
