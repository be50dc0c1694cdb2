// torch.save's file format for a dict of tensors, the writing half (train/torch_pickle.h;
// torch_pickle.cpp, the reading half, describes the format).
#include "train/torch_pickle.h"

#include <caffe2/serialize/inline_container.h>

#include <sstream>

#include "hddp/core/error.h"

namespace hddp {
namespace train {

namespace {

class PickleWriter {
 public:
  void proto() { out_ += "\x80\x02"; }
  void global(const std::string& module, const std::string& name) {
    out_ += 'c';
    out_ += module + "\n" + name + "\n";
  }
  void string(const std::string& s) {
    out_ += 'X';
    uint32_t n = static_cast<uint32_t>(s.size());
    out_.append(reinterpret_cast<const char*>(&n), 4);  // little-endian hosts only (checked)
    out_ += s;
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v >= 0 && v < 65536) {
      out_ += 'M';
      out_ += static_cast<char>(v & 0xff);
      out_ += static_cast<char>((v >> 8) & 0xff);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      const int32_t w = static_cast<int32_t>(v);
      out_.append(reinterpret_cast<const char*>(&w), 4);
    } else {
      out_ += '\x8a';  // LONG1: 8 bytes, little-endian two's complement
      out_ += static_cast<char>(8);
      out_.append(reinterpret_cast<const char*>(&v), 8);
    }
  }
  void op(char c) { out_ += c; }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

}  // namespace

std::string torchSaveBytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  const uint16_t probe = 1;
  HDDP_CHECK(*reinterpret_cast<const uint8_t*>(&probe) == 1,
             "torch.save's format is written on little-endian hosts only");
  PickleWriter w;
  w.proto();
  w.global("collections", "OrderedDict");
  w.op(')');
  w.op('R');
  w.op('(');
  std::vector<at::Tensor> data;
  for (const auto& [key, tensor] : tensors) {
    const at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    std::string storage;
    for (const auto& [name, dtype] : torchStorageTypes()) {
      if (dtype == t.scalar_type()) {
        storage = name;
      }
    }
    HDDP_CHECK_AS(ConfigError, !storage.empty(), "state dict: '", key, "' is of dtype ",
                  t.scalar_type(), ", which hddp does not write in torch.save's format");
    w.string(key);
    w.global("torch._utils", "_rebuild_tensor_v2");
    w.op('(');
    w.op('(');
    w.string("storage");
    w.global("torch", storage);
    w.string(std::to_string(data.size()));
    w.string("cpu");
    w.integer(t.numel());
    w.op('t');
    w.op('Q');
    w.integer(0);
    w.op('(');
    for (int64_t s : t.sizes()) {
      w.integer(s);
    }
    w.op('t');
    w.op('(');
    for (int64_t s : t.strides()) {
      w.integer(s);
    }
    w.op('t');
    w.op('\x89');  // requires_grad False
    w.global("collections", "OrderedDict");
    w.op(')');
    w.op('R');
    w.op('t');
    w.op('R');
    data.push_back(t);
  }
  w.op('u');
  w.op('.');
  std::ostringstream out;
  caffe2::serialize::PyTorchStreamWriter archive([&](const void* bytes, size_t n) {
    out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
    return n;
  });
  archive.writeRecord("data.pkl", w.bytes().data(), w.bytes().size());
  archive.writeRecord("byteorder", "little", 6);
  for (size_t k = 0; k < data.size(); ++k) {
    archive.writeRecord("data/" + std::to_string(k), data[k].data_ptr(), data[k].nbytes());
  }
  archive.writeEndOfFile();
  return out.str();
}

}  // namespace train
}  // namespace hddp
