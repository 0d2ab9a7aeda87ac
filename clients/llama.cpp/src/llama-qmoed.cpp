// llama-qmoed.cpp - see llama-qmoed.h. Part of qmoed (clients/llama.cpp).
#include "llama-qmoed.h"

#include "llama.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model-loader.h"

#include "ggml.h"

#include <nlohmann/json.hpp>
#include <qmoe_client.h>

#include <condition_variable>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char ** environ;

using json = nlohmann::ordered_json;

namespace {

// The layer calls' answers are bounded by this (qm_client's default): a
// daemon that stops answering ends the run with an error after it.
constexpr int QMOED_TIMEOUT_MS = QM_CLIENT_DEFAULT_TIMEOUT_MS;

// Regions of the session's map start at multiples of 64 (PROTOCOL.md).
uint64_t align64(uint64_t n) {
    return (n + 63) & ~uint64_t(63);
}

[[noreturn]] void refuse(const std::string & why) {
    throw std::runtime_error("qmoed: " + why);
}

std::string base_name(const std::string & path) {
    const size_t slash = path.find_last_of('/');
    return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool valid_model_name(const std::string & s) {
    if (s.empty() || s.size() > 64) {
        return false;
    }
    for (char c : s) {
        if (!(isalnum((unsigned char) c) || c == '.' || c == '_' || c == '-')) {
            return false;
        }
    }
    return true;
}

std::string str_or(const char * s) {
    return s ? std::string(s) : std::string();
}

std::string list_str(const std::vector<int> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); i++) {
        s += (i ? "," : "") + std::to_string(v[i]);
    }
    return s + "]";
}

// --qmoed-budget as the daemon's `budget`: "NN%" and "auto" as given (the
// daemon says what they come to, and refuses a bad one naming the rule),
// "123", "8G", "512M" (binary units) as bytes; "" when `s` is empty. A size
// that is not one is refused here, at load.
std::string wire_budget(const std::string & s) {
    if (s.empty() || s == "auto" || s.back() == '%') {
        return s;
    }
    const std::string rule = format("--qmoed-budget '%s': expected bytes (with an optional K, M, G or T suffix), "
                                    "a percentage of the bank's expert bytes such as 50%%, or auto", s.c_str());
    char * end = nullptr;
    errno = 0;
    const unsigned long long v = strtoull(s.c_str(), &end, 10);
    if (errno || end == s.c_str() || s[0] == '-') {
        refuse(rule);
    }
    unsigned shift = 0;
    if (*end) {
        const std::string suffix(end);
        if (suffix == "K" || suffix == "k") {
            shift = 10;
        } else if (suffix == "M") {
            shift = 20;
        } else if (suffix == "G") {
            shift = 30;
        } else if (suffix == "T") {
            shift = 40;
        } else {
            refuse(rule);
        }
    }
    if (v == 0 || v > (ULLONG_MAX >> shift)) {
        refuse(rule);
    }
    return std::to_string((unsigned long long) v << shift);
}

// One connection; closed when it goes out of scope.
struct client_handle {
    qm_client * c = nullptr;
    ~client_handle() { qm_client_close(c); }
};

void open_client(client_handle & h, const std::string & socket) {
    qm_client_error err;
    if (qm_client_open(&h.c, socket.c_str(), QMOED_TIMEOUT_MS, &err) != 0) {
        refuse(format("cannot reach the daemon at %s (--qmoed): %s", socket.c_str(), err.reason));
    }
}

// The result of `method` (no params) at the daemon, parsed.
json call_result(qm_client * c, const std::string & socket, const char * method) {
    qm_client_error err;
    char * text = nullptr;
    if (qm_client_call_json(c, method, nullptr, 0, &text, &err) != 0) {
        refuse(format("%s at %s failed: %s", method, socket.c_str(), err.reason));
    }
    json r;
    try {
        r = json::parse(text);
    } catch (const std::exception & e) {
        qm_client_string_free(text);
        refuse(format("the daemon at %s answered %s with text that is not JSON: %s", socket.c_str(), method,
                      e.what()));
    }
    qm_client_string_free(text);
    return r;
}

// The GGUF architectures whose experts the daemon serves (daemon.status's
// families: the daemon's one family table), and in words for a refusal.
std::set<std::string> served_archs(qm_client * c, const std::string & socket, std::string * words) {
    const json r = call_result(c, socket, "daemon.status");
    std::set<std::string> archs;
    if (r.contains("families") && r["families"].is_array()) {
        for (const auto & f : r["families"]) {
            if (!f.is_object() || !f.contains("gguf_arch") || !f["gguf_arch"].is_string()) {
                continue;
            }
            const std::string a = f["gguf_arch"].get<std::string>();
            *words += (words->empty() ? "" : ", ") + a + " (" + f.value("name", "?") + ")";
            archs.insert(a);
        }
    }
    if (archs.empty()) {
        refuse(format("the daemon at %s lists no model families it serves (daemon.status): it is older than "
                      "this llama.cpp", socket.c_str()));
    }
    return archs;
}

// model.list's entry for `name`, or a null json when the daemon lacks it.
json find_model(qm_client * c, const std::string & socket, const std::string & name) {
    const json r = call_result(c, socket, "model.list");
    if (r.contains("models") && r["models"].is_array()) {
        for (const auto & m : r["models"]) {
            if (m.is_object() && m.value("name", "") == name) {
                return m;
            }
        }
    }
    return json();
}

uint64_t u64_of(const json & m, const char * key, const std::string & name) {
    if (!m.contains(key) || !m[key].is_number_unsigned()) {
        refuse(format("the daemon's model.list entry for '%s' lacks %s", name.c_str(), key));
    }
    return m[key].get<uint64_t>();
}

// `qmoe-bank import gguf GGUF --out BANK` (qmoe-bank from $PATH).
void import_bank(const std::string & gguf, const std::string & bank) {
    LLAMA_LOG_INFO("qmoed: %s does not exist: importing %s into it (qmoe-bank import gguf)\n",
                   bank.c_str(), gguf.c_str());
    const char * argv[] = {"qmoe-bank", "import", "gguf", gguf.c_str(), "--out", bank.c_str(), "--quiet", nullptr};
    pid_t pid;
    int rc = posix_spawnp(&pid, "qmoe-bank", nullptr, nullptr, const_cast<char * const *>(argv), environ);
    if (rc != 0) {
        refuse(format("--qmoed-bank %s does not exist and qmoe-bank (to import it) cannot be run: %s",
                      bank.c_str(), strerror(rc)));
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        refuse(format("qmoe-bank import gguf %s --out %s failed (%s %d); its message is above",
                      gguf.c_str(), bank.c_str(), WIFEXITED(status) ? "exit status" : "signal",
                      WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status)));
    }
}

// One MoE block of the GGUF.
struct gguf_block {
    int il;
    bool biases;
};

// The GGUF's MoE blocks and their shapes; refuses shapes qmoed cannot serve.
std::vector<gguf_block> moe_blocks(const llama_hparams & hp, const llama_model_loader & ml,
                                   uint32_t * n_ff, std::set<std::string> * names) {
    static const char * const proj[] = {"gate", "up", "down"};
    std::vector<gguf_block> blocks;
    const uint32_t E = hp.n_expert, H = hp.n_embd;
    *n_ff = 0;
    for (int il = 0; il < (int) hp.n_layer(); il++) {
        if (ml.get_tensor_meta(format("blk.%d.ffn_gate_up_exps.weight", il).c_str())) {
            refuse(format("blk.%d.ffn_gate_up_exps.weight: fused gate/up expert tensors are not served "
                          "(qmoe-bank import gguf refuses them too)", il));
        }
        const ggml_tensor * t[3];
        int present = 0;
        for (int p = 0; p < 3; p++) {
            t[p] = ml.get_tensor_meta(format("blk.%d.ffn_%s_exps.weight", il, proj[p]).c_str());
            present += t[p] != nullptr;
        }
        if (present == 0) {
            continue;
        }
        if (present != 3) {
            refuse(format("block %d has only some of ffn_{gate,up,down}_exps.weight", il));
        }
        const uint32_t I = (uint32_t) t[0]->ne[1];
        if (*n_ff == 0) {
            *n_ff = I;
        }
        for (int p = 0; p < 3; p++) {
            const bool down = p == 2;
            const int64_t want0 = down ? *n_ff : H, want1 = down ? H : *n_ff;
            if (t[p]->ne[0] != want0 || t[p]->ne[1] != want1 || t[p]->ne[2] != E || t[p]->ne[3] != 1) {
                refuse(format("blk.%d.ffn_%s_exps.weight is [%lld, %lld, %lld]; a bank needs [%lld, %lld, %u] "
                              "(one expert width over the blocks)", il, proj[p], (long long) t[p]->ne[0],
                              (long long) t[p]->ne[1], (long long) t[p]->ne[2], (long long) want0,
                              (long long) want1, E));
            }
        }
        int nb = 0;
        for (int p = 0; p < 3; p++) {
            nb += ml.get_tensor_meta(format("blk.%d.ffn_%s_exps.bias", il, proj[p]).c_str()) != nullptr;
        }
        if (nb != 0 && nb != 3) {
            refuse(format("block %d has only some of ffn_{gate,up,down}_exps.bias", il));
        }
        for (int p = 0; p < 3; p++) {
            names->insert(format("blk.%d.ffn_%s_exps.weight", il, proj[p]));
            if (nb) {
                names->insert(format("blk.%d.ffn_%s_exps.bias", il, proj[p]));
            }
        }
        blocks.push_back({il, nb == 3});
    }
    return blocks;
}

// Every way the bank `m` (model.list's entry: its shape, layer map, source,
// biases and SwiGLU) can fail to be the GGUF's experts; "" when it is.
std::string mismatch(const json & m, const std::string & name, const std::string & gguf_base,
                     llm_arch arch, const llama_hparams & hp, uint32_t n_ff, const std::vector<gguf_block> & blocks,
                     std::vector<int> * bank_blocks) {
    const uint64_t experts = u64_of(m, "experts", name), hidden = u64_of(m, "hidden_size", name);
    const uint64_t inter = u64_of(m, "inter_size", name), layers = u64_of(m, "layers", name);
    const std::string path = m.value("path", "");
    const std::string bank = format("bank '%s' (%s)", name.c_str(), path.c_str());
    if (experts != hp.n_expert) {
        return format("%s has %llu experts per layer; the GGUF's blocks have %u", bank.c_str(),
                      (unsigned long long) experts, hp.n_expert);
    }
    if (hidden != hp.n_embd || inter != n_ff) {
        return format("%s has experts of hidden size %llu and width %llu; the GGUF's are %u and %u", bank.c_str(),
                      (unsigned long long) hidden, (unsigned long long) inter, hp.n_embd, n_ff);
    }
    bank_blocks->clear();
    if (m.contains("layer_map") && m["layer_map"].is_array()) {
        for (const auto & v : m["layer_map"]) {
            bank_blocks->push_back(v.is_number_unsigned() ? v.get<int>() : -1);
        }
    } else {
        for (uint64_t l = 0; l < layers; l++) {
            bank_blocks->push_back((int) l);
        }
    }
    std::vector<int> want;
    for (const auto & b : blocks) {
        want.push_back(b.il);
    }
    if (*bank_blocks != want) {
        return format("%s serves blocks %s (its layer map); the GGUF's MoE blocks are %s", bank.c_str(),
                      list_str(*bank_blocks).c_str(), list_str(want).c_str());
    }
    std::string src_file, src_arch, src_format;
    if (m.contains("source") && m["source"].is_object()) {
        const json & src = m["source"];
        src_format = src.value("format", "");
        src_arch = src.value("arch", "");
        if (src.contains("files") && src["files"].is_array() && src["files"].size() == 1 &&
            src["files"][0].is_string()) {
            src_file = src["files"][0].get<std::string>();
        }
    }
    if (src_format != "gguf" || src_file != gguf_base) {
        const std::string named = src_format != "gguf" ? (src_format.empty() ? "no GGUF" : "a " + src_format + " import")
                                                        : "'" + src_file + "'";
        return format("%s was not imported from this GGUF: its qmoe.source names %s, not '%s'", bank.c_str(),
                      named.c_str(), gguf_base.c_str());
    }
    if (!src_arch.empty() && src_arch != llm_arch_name(arch)) {
        return format("%s was imported from a %s GGUF; this one is %s", bank.c_str(), src_arch.c_str(),
                      llm_arch_name(arch));
    }
    const bool bank_biases = m.value("biases", false);
    if (bank_biases != blocks[0].biases) {
        return format("%s %s expert biases; the GGUF's experts %s", bank.c_str(), bank_biases ? "has" : "has no",
                      blocks[0].biases ? "have them" : "do not");
    }
    const bool oai = arch == LLM_ARCH_OPENAI_MOE;
    double alpha = 1.0, limit = INFINITY;
    if (m.contains("swiglu") && m["swiglu"].is_object()) {
        const json & sw = m["swiglu"];
        alpha = sw.contains("alpha") && sw["alpha"].is_number() ? sw["alpha"].get<double>() : 1.0;
        limit = sw.contains("limit") && sw["limit"].is_number() ? sw["limit"].get<double>() : INFINITY;
    }
    if (oai != (std::fabs(alpha - 1.702) < 1e-6 && limit == 7.0)) {
        return format("%s's activation (alpha %g, limit %s) is not the %s SwiGLU llama.cpp computes", bank.c_str(),
                      alpha, std::isinf(limit) ? "none" : format("%g", limit).c_str(),
                      oai ? "gpt-oss (alpha 1.702, limit 7)" : "plain");
    }
    return "";
}

} // namespace

std::shared_ptr<llama_qmoed_model> llama_qmoed_attach(
        const llama_qmoed_params & p, const std::string & gguf_path, llm_arch arch,
        const llama_hparams & hp, const llama_model_loader & ml, std::set<std::string> * skip) {
    auto q = std::make_shared<llama_qmoed_model>();
    q->socket = str_or(p.socket);
    if (q->socket.empty()) {
        refuse("--qmoed needs the daemon's socket path");
    }
    const std::string gguf_base = base_name(gguf_path);
    q->name = str_or(p.model);
    if (q->name.empty()) {
        q->name = gguf_base;
        const size_t dot = q->name.rfind(".gguf");
        if (dot != std::string::npos && dot + 5 == q->name.size()) {
            q->name.resize(dot);
        }
        if (!valid_model_name(q->name)) {
            refuse(format("the GGUF's base name '%s' is not a qmoed model name (1 to 64 of [A-Za-z0-9._-]): "
                          "pass --qmoed-model NAME", q->name.c_str()));
        }
    }
    q->policy = str_or(p.policy);
    q->budget = str_or(p.budget);
    q->precision = str_or(p.precision);
    q->on_miss = str_or(p.on_miss);

    // The families qmoed serves are the daemon's (daemon.status), not a list here.
    client_handle h;
    open_client(h, q->socket);
    std::string served;
    if (!served_archs(h.c, q->socket, &served).count(llm_arch_name(arch))) {
        refuse(format("the experts of a %s model are not served: qmoed serves %s GGUFs", llm_arch_name(arch),
                      served.c_str()));
    }
    if (hp.n_expert == 0) {
        refuse(format("%s has no experts (%s.expert_count is 0): nothing to serve", gguf_base.c_str(),
                      llm_arch_name(arch)));
    }
    uint32_t n_ff = 0;
    std::set<std::string> names;
    const std::vector<gguf_block> blocks = moe_blocks(hp, ml, &n_ff, &names);
    if (blocks.empty()) {
        refuse(format("%s has no ffn_{gate,up,down}_exps tensors: nothing to serve", gguf_base.c_str()));
    }
    if (arch != LLM_ARCH_OPENAI_MOE) {
        for (const auto & b : blocks) {
            if (hp.swiglu_clamp_exp[b.il] > 1e-6f) {
                refuse(format("block %d clamps its experts' SwiGLU at %g, which a bank cannot express", b.il,
                              hp.swiglu_clamp_exp[b.il]));
            }
        }
    }

    json m = find_model(h.c, q->socket, q->name);
    bool loaded_here = false;
    if (m.is_null()) {
        const std::string bank = str_or(p.bank);
        if (bank.empty()) {
            refuse(format("the daemon at %s has no model '%s' (--qmoed-model): pass --qmoed-bank FILE to load one",
                          q->socket.c_str(), q->name.c_str()));
        }
        struct stat sb;
        if (stat(bank.c_str(), &sb) != 0) {
            if (errno != ENOENT) {
                refuse(format("--qmoed-bank %s: %s", bank.c_str(), strerror(errno)));
            }
            import_bank(gguf_path, bank);
        }
        char * abs = realpath(bank.c_str(), nullptr);
        if (!abs) {
            refuse(format("--qmoed-bank %s: %s", bank.c_str(), strerror(errno)));
        }
        const std::string bank_abs(abs);
        free(abs);
        qm_client_error err;
        if (qm_client_model_load(h.c, q->name.c_str(), bank_abs.c_str(), nullptr, &err) != 0) {
            refuse(format("the daemon at %s cannot load %s as '%s': %s", q->socket.c_str(), bank_abs.c_str(),
                          q->name.c_str(), err.reason));
        }
        loaded_here = true;
        m = find_model(h.c, q->socket, q->name);
        if (m.is_null()) {
            refuse(format("the daemon at %s loaded '%s' but does not list it", q->socket.c_str(), q->name.c_str()));
        }
    }

    std::vector<int> bank_blocks;
    std::string why;
    try {
        why = mismatch(m, q->name, gguf_base, arch, hp, n_ff, blocks, &bank_blocks);
    } catch (const std::runtime_error & e) {
        why = e.what();
    }
    if (!why.empty()) {
        if (loaded_here) {
            qm_client_error err;
            qm_client_model_unload(h.c, q->name.c_str(), 0, &err);
        }
        refuse(why.rfind("qmoed: ", 0) == 0 ? why.substr(7) : why);
    }

    if (p.bank && *p.bank) {
        char * abs = realpath(p.bank, nullptr);
        q->bank = abs ? std::string(abs) : std::string();
        free(abs);
    }
    q->bank_bytes = u64_of(m, "bytes_total", q->name);
    q->n_embd = hp.n_embd;
    q->n_expert_used = hp.n_expert_used_max();
    q->bank_layer.assign(hp.n_layer(), -1);
    for (size_t l = 0; l < bank_blocks.size(); l++) {
        q->bank_layer[bank_blocks[l]] = (int32_t) l;
    }
    q->budget = wire_budget(q->budget); // a bad size is refused at load, not per context
    size_t skipped = 0;
    for (const auto & n : names) {
        skipped += ggml_nbytes(ml.get_tensor_meta(n.c_str()));
    }
    q->other_bytes = ml.n_bytes > skipped ? ml.n_bytes - skipped : 0;
    skip->insert(names.begin(), names.end());
    LLAMA_LOG_INFO("qmoed: %zu MoE blocks %s served by '%s' at %s; their expert tensors (%.2f MiB) are not loaded\n",
                   blocks.size(), list_str(bank_blocks).c_str(), q->name.c_str(), q->socket.c_str(),
                   skipped / 1048576.0);
    return q;
}

struct llama_qmoed_layer_op {
    llama_qmoed_session * s = nullptr;
    int il = -1;
    int bank_layer = -1;
};

struct llama_qmoed_session {
    std::shared_ptr<const llama_qmoed_model> model;
    qm_client * client = nullptr;
    char * id = nullptr;
    qm_client_map map = {};
    uint32_t rows_cap = 0, k_cap = 0;
    uint64_t off_ids = 0, off_weights = 0, off_out = 0;
    bool ring = false; // the layer calls go through the session's call ring (else the socket)
    std::vector<llama_qmoed_layer_op> ops; // per block; fixed once open (graphs point into it)

    // Written by the graph's thread 0 during a compute, read after it.
    bool failed = false; // this graph: a layer call failed (cleared when reported)
    bool gone = false;   // the last layer call found the daemon gone for good
    bool dry = false;    // a context that only measures memory
    std::string why;
    uint64_t calls = 0, rows = 0, compute_us = 0, queue_us = 0, op_us = 0, hits = 0, misses = 0, bytes_paged = 0;

    // Where the graph's other threads sleep while thread 0 waits for the
    // daemon (ggml's own barrier would spin on a core the daemon needs).
    std::mutex mu;
    std::condition_variable cv;
    int arrived = 0;
    uint64_t generation = 0;

    void barrier(int nth) {
        std::unique_lock<std::mutex> lk(mu);
        const uint64_t gen = generation;
        if (++arrived == nth) {
            arrived = 0;
            generation++;
            cv.notify_all();
            return;
        }
        cv.wait(lk, [&] { return generation != gen; });
    }

    void fail(const llama_qmoed_layer_op & op, int rc, const qm_client_error & err) {
        failed = true;
        gone = rc == QM_CLIENT_EIO || rc == QM_CLIENT_ENOTRUNNING || rc == QM_CLIENT_ETIMEDOUT;
        const char * sock = model->socket.c_str();
        if (rc == QM_CLIENT_EIO || rc == QM_CLIENT_ENOTRUNNING) {
            why = format("qmoed: the daemon at %s went away during block %d's experts (bank layer %d): %s",
                         sock, op.il, op.bank_layer, err.reason);
        } else if (rc == QM_CLIENT_ETIMEDOUT) {
            why = format("qmoed: the daemon at %s did not answer block %d's experts within %d ms: %s", sock, op.il,
                         QMOED_TIMEOUT_MS, err.reason);
        } else {
            why = format("qmoed: the daemon at %s refused block %d's experts (bank layer %d): %s (%s%s%s)", sock,
                         op.il, op.bank_layer, err.reason, err.name, err.field[0] ? ", field " : "", err.field);
        }
    }

    void run(const llama_qmoed_layer_op & op, ggml_tensor * dst) {
        const int64_t t0 = ggml_time_us();
        const ggml_tensor * x = dst->src[0], * ids = dst->src[1], * w = dst->src[2];
        float * out = (float *) dst->data;
        const int64_t H = x->ne[0], T = x->ne[1], k = ids->ne[0];
        if (failed || dry || !client) {
            failed = true;
            if (!dry && !client) {
                why = "qmoed: the context computed before its session was made (llama_qmoed_session_connect)";
            }
            memset(out, 0, ggml_nbytes(dst));
            return;
        }
        if (x->type != GGML_TYPE_F32 || ids->type != GGML_TYPE_I32 || w->type != GGML_TYPE_F32 ||
            H != model->n_embd || k > k_cap || ids->ne[1] != T || w->ne[0] != 1 || w->ne[1] != k ||
            w->ne[2] != T) {
            failed = true;
            why = format("qmoed: block %d's op got inputs it cannot send (hidden %lld x %lld, %lld experts per "
                         "token; the map holds %u)", op.il, (long long) H, (long long) T, (long long) k, k_cap);
            memset(out, 0, ggml_nbytes(dst));
            return;
        }
        uint8_t * base = (uint8_t *) map.data;
        for (int64_t r0 = 0; r0 < T; r0 += rows_cap) {
            const int64_t n = std::min<int64_t>(rows_cap, T - r0);
            float * mx = (float *) base;
            int32_t * mi = (int32_t *) (base + off_ids);
            float * mw = (float *) (base + off_weights);
            for (int64_t t = 0; t < n; t++) {
                const char * xr = (const char *) x->data + (r0 + t) * x->nb[1];
                if (x->nb[0] == sizeof(float)) {
                    memcpy(mx + t * H, xr, H * sizeof(float));
                } else {
                    for (int64_t i = 0; i < H; i++) {
                        mx[t * H + i] = *(const float *) (xr + i * x->nb[0]);
                    }
                }
                for (int64_t j = 0; j < k; j++) {
                    mi[t * k + j] = *(const int32_t *) ((const char *) ids->data + j * ids->nb[0] + (r0 + t) * ids->nb[1]);
                    mw[t * k + j] = *(const float *) ((const char *) w->data + j * w->nb[1] + (r0 + t) * w->nb[2]);
                }
            }
            const qm_client_region r_ids = {QM_CLIENT_I32, (uint64_t) n, (uint64_t) k, off_ids};
            const qm_client_region r_w = {QM_CLIENT_F32, (uint64_t) n, (uint64_t) k, off_weights};
            qm_client_mapped_infer q = {};
            q.session = id;
            q.layer = (uint64_t) op.bank_layer;
            q.map = &map;
            q.hidden = {QM_CLIENT_F32, (uint64_t) n, (uint64_t) H, 0};
            q.topk_ids = &r_ids;
            q.topk_weights = &r_w;
            q.output_offset = off_out;
            qm_client_infer_stats st;
            qm_client_error err;
            const int rc = qm_client_session_infer_mapped(client, &q, &st, &err);
            if (rc != 0) {
                fail(op, rc, err);
                memset(out, 0, ggml_nbytes(dst));
                return;
            }
            memcpy(out + r0 * H, base + off_out, n * H * sizeof(float));
            gone = false;
            calls++;
            rows += n;
            compute_us += st.compute_us;
            queue_us += st.queue_us;
            hits += st.hits;
            misses += st.misses;
            bytes_paged += st.bytes_paged;
        }
        op_us += ggml_time_us() - t0;
    }
};

namespace {

// libqmoe-client's reconnection steps, one line each.
void client_log(void *, const char * line) {
    LLAMA_LOG_WARN("%s\n", line);
}

void qmoed_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    auto * op = (llama_qmoed_layer_op *) userdata;
    if (ith == 0) {
        op->s->run(*op, dst);
    }
    if (nth > 1) {
        op->s->barrier(nth);
    }
}

} // namespace

void llama_qmoed_session_deleter::operator()(llama_qmoed_session * s) const {
    if (!s) {
        return;
    }
    if (s->calls) {
        LLAMA_LOG_INFO("qmoed: session %s: %llu layer calls (%s), %llu rows: daemon compute %.1f ms, queue %.1f ms, "
                       "%.1f ms in the op (%.1f us per call beyond the daemon's compute); expert hits %llu, "
                       "misses %llu, %.2f MiB paged\n",
                       s->id, (unsigned long long) s->calls,
                       qm_client_ring_active(s->client, s->id) ? "call ring" : "socket",
                       (unsigned long long) s->rows, s->compute_us / 1e3,
                       s->queue_us / 1e3, s->op_us / 1e3,
                       (double) (s->op_us - std::min(s->op_us, s->compute_us)) / (double) s->calls,
                       (unsigned long long) s->hits, (unsigned long long) s->misses, s->bytes_paged / 1048576.0);
    }
    qm_client_error err;
    if (s->gone || s->dry || !s->client) {
        qm_client_map_release(nullptr, &s->map, &err);
    } else {
        qm_client_map_release(s->client, &s->map, &err);
        if (s->id) {
            qm_client_session_close(s->client, s->id, &err);
        }
    }
    qm_client_string_free(s->id);
    qm_client_close(s->client);
    delete s;
}

llama_qmoed_session_ptr llama_qmoed_session_open(std::shared_ptr<const llama_qmoed_model> model, uint32_t n_ubatch,
                                                 bool dry_run) {
    llama_qmoed_session_ptr s(new llama_qmoed_session());
    s->model = model;
    s->ops.resize(model->bank_layer.size());
    for (size_t il = 0; il < model->bank_layer.size(); il++) {
        s->ops[il] = {s.get(), (int) il, model->bank_layer[il]};
    }
    s->rows_cap = std::max<uint32_t>(1, n_ubatch);
    if (dry_run) {
        s->dry = true;
        s->why = "qmoed: a context that only measures memory computes nothing";
    }
    return s;
}

void llama_qmoed_session_connect(llama_qmoed_session * s, uint64_t compute_bytes, uint64_t mapped_bytes) {
    if (!s || s->dry || s->client) {
        return;
    }
    const std::shared_ptr<const llama_qmoed_model> & model = s->model;
    const std::string & sock = model->socket;
    qm_client_error err;
    if (qm_client_open(&s->client, sock.c_str(), QMOED_TIMEOUT_MS, &err) != 0) {
        refuse(format("cannot reach the daemon at %s (--qmoed): %s", sock.c_str(), err.reason));
    }
    // Across a restart: the client's steps in llama.cpp's log, and the bank
    // it may load again (docs/ENGINES.md "Across a daemon restart").
    qm_client_reconnect rec;
    qm_client_get_reconnect(s->client, &rec);
    rec.log = client_log;
    qm_client_set_reconnect(s->client, &rec);
    if (!model->bank.empty() &&
        qm_client_set_model_bank(s->client, model->name.c_str(), model->bank.c_str(), &err) != 0) {
        refuse(format("cannot remember bank %s: %s", model->bank.c_str(), err.reason));
    }
    const std::string params_json = model->on_miss.empty() ? "" : "{\"on_miss\":\"" + model->on_miss + "\"}";
    qm_client_session_params sp = {};
    sp.model = model->name.c_str();
    sp.policy = model->policy.empty() ? nullptr : model->policy.c_str();
    sp.budget = model->budget.empty() ? nullptr : model->budget.c_str();
    sp.policy_params_json = params_json.empty() ? nullptr : params_json.c_str();
    sp.precision = model->precision.empty() ? nullptr : model->precision.c_str();
    // What this context takes after the session is made: an auto budget leaves it free.
    const bool auto_budget = model->budget == "auto";
    if (auto_budget) {
        sp.client_pending_bytes = compute_bytes + mapped_bytes;
    }
    qm_client_plan_summary sum;
    if (qm_client_session_create(s->client, &sp, &s->id, &sum, &err) != 0) {
        refuse(format("the daemon at %s refused a session of '%s': %s%s%s", sock.c_str(), model->name.c_str(),
                      err.reason, err.field[0] ? " (field " : "", err.field[0] ? (std::string(err.field) + ")").c_str() : ""));
    }
    s->k_cap = std::max<uint32_t>(1, model->n_expert_used);
    const uint64_t H = model->n_embd;
    s->off_ids = align64((uint64_t) s->rows_cap * H * sizeof(float));
    s->off_weights = s->off_ids + align64((uint64_t) s->rows_cap * s->k_cap * sizeof(int32_t));
    s->off_out = s->off_weights + align64((uint64_t) s->rows_cap * s->k_cap * sizeof(float));
    const uint64_t bytes = s->off_out + align64((uint64_t) s->rows_cap * H * sizeof(float));
    if (qm_client_map_create(s->client, s->id, bytes, &s->map, &err) != 0) {
        const std::string why = format("the daemon at %s refused a %llu-byte map for session %s: %s", sock.c_str(),
                                       (unsigned long long) bytes, s->id, err.reason);
        qm_client_plan_summary_free(&sum);
        refuse(why);
    }
    // One call ring per context: thread 0 of the op rings the daemon and
    // waits on it itself (no thread of ours in between). A daemon without
    // rings, or one that refuses, leaves the layer calls on the socket.
    s->ring = qm_client_session_ring(s->client, s->id, &err) == 0;
    if (!s->ring) {
        LLAMA_LOG_WARN("qmoed: session %s: no call ring (%s: %s); layer calls go through the socket\n", s->id,
                       err.name, err.reason);
    }
    LLAMA_LOG_INFO("qmoed: session %s of '%s': policy %s, budget %llu of %llu expert bytes%s%s; %llu-byte map for %u rows; "
                   "layer calls through %s\n",
                   s->id, model->name.c_str(), sum.policy ? sum.policy : "?", (unsigned long long) sum.budget_bytes,
                   (unsigned long long) model->bank_bytes, sum.budget_auto ? " (" : "",
                   sum.budget_auto ? (std::string(sum.budget_auto) + ")").c_str() : "", (unsigned long long) bytes,
                   s->rows_cap, s->ring ? "its call ring" : "the socket");
    if (auto_budget) {
        LLAMA_LOG_INFO("qmoed: session %s: the auto budget was told what this context takes next: compute "
                       "buffers %.2f MiB, mapped weights %.2f MiB\n",
                       s->id, compute_bytes / 1048576.0, mapped_bytes / 1048576.0);
    }
    qm_client_plan_summary_free(&sum);
}

bool llama_qmoed_serves(const llama_qmoed_session * s, int il) {
    return s && s->model->serves(il);
}

ggml_tensor * llama_qmoed_build_moe(ggml_context * ctx, llama_qmoed_session * s, int il,
                                    ggml_tensor * cur, ggml_tensor * selected, ggml_tensor * weights) {
    ggml_tensor * args[3] = {cur, selected, weights};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, cur->ne[0], cur->ne[1], 1, 1, args, 3, qmoed_op, GGML_N_TASKS_MAX,
                          &s->ops[il]);
}

bool llama_qmoed_failed(llama_qmoed_session * s, std::string * why) {
    if (!s || !s->failed) {
        return false;
    }
    if (why) {
        *why = s->why;
    }
    s->failed = false;
    return true;
}
