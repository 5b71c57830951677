// Segment-store entry files (a --cache-dir is outside input: another process, a full disk, a
// hostile local user). A valid entry is written once; each input then damages it (XOR edits at
// chosen offsets, a cut) or, when it starts with 'R', replaces it outright. Loading must reject
// every damaged file (null, quarantined) or return an entry whose tensors are all readable.
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "fuzz_common.h"
#include "pic/segment_store.h"

using namespace hypic;

namespace {
struct Fixture {
  std::unique_ptr<Backend> be = make_backend("cpu", 1);
  std::unique_ptr<SegmentStore> store;
  SegmentKey key;
  std::string valid;  // the bytes of a valid entry file for key
  Fixture() {
    store = std::make_unique<SegmentStore>(fuzz::scratch_dir() + "/store", *be);
    key.model_fingerprint = 0x1234;
    key.seam = 1;
    key.ids = {5, 6, 7};
    SegmentEntry e;
    e.key = key;
    auto filled = [](Shape s, float v) {
      Tensor t = Tensor::empty(DType::F32, std::move(s));
      for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = v + 0.01f * static_cast<float>(i);
      return t;
    };
    LayerSummary lin;
    lin.T = filled({2, 4, 4}, 1.f);
    lin.S = filled({2, 4, 3}, 2.f);
    lin.conv_tail = filled({3, 20}, 3.f);
    LayerSummary full;
    full.k = filled({3, 1, 8}, 4.f);
    full.v = filled({3, 1, 8}, 5.f);
    e.layers = {lin, full};
    e.account();
    if (!store->save(e)) std::abort();
    valid = fuzz::read_text(store->path_for(key));
    if (valid.empty()) std::abort();
  }
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fx;
  std::string bytes;
  if (size > 0 && data[0] == 'R') {
    bytes.assign(reinterpret_cast<const char*>(data) + 1, size - 1);
  } else {
    bytes = fx.valid;
    size_t i = 0;
    if (size % 4 == 1) bytes.resize(static_cast<size_t>(data[i++]) * bytes.size() / 256);
    for (; i + 3 <= size && !bytes.empty(); i += 3) {
      const size_t at = (static_cast<size_t>(data[i]) << 8 | data[i + 1]) % bytes.size();
      bytes[at] = static_cast<char>(bytes[at] ^ data[i + 2]);
    }
  }
  const std::string path = fx.store->path_for(fx.key);
  fuzz::write_file(path, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  try {
    auto e = fx.store->load(fx.key);
    if (e) {
      float sum = 0;
      for (const auto& l : e->layers)
        for (const Tensor* t : {&l.T, &l.S, &l.conv_tail, &l.k, &l.v})
          if (t->defined() && t->dtype() == DType::F32)
            for (int64_t j = 0; j < t->numel(); ++j) sum += t->data<float>()[j];
      (void)static_cast<volatile float>(sum);
    }
  } catch (const std::exception&) {
  }
  return 0;
}
