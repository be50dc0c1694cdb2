#include "train/event_file.h"

#include <array>

#include "train/tensorboard_event.pb.h"

namespace hddp {
namespace train {
namespace {

namespace pb = ::hddp::tensorboard;

// CRC-32C's byte table for the reflected polynomial 0x82F63B78.
std::array<uint32_t, 256> makeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 1u) != 0 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    table[i] = crc;
  }
  return table;
}

void appendLittleEndian(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFu));
  }
}

std::string serialized(const pb::Event& event) {
  std::string bytes;
  event.SerializeToString(&bytes);
  return bytes;
}

pb::Event eventAt(int64_t step, double wallTime) {
  pb::Event event;
  event.set_wall_time(wallTime);
  event.set_step(step);
  return event;
}

}  // namespace

const char* const kEventFileVersion = "brain.Event:2";

uint32_t crc32c(const void* data, size_t size) {
  static const std::array<uint32_t, 256> kTable = makeCrc32cTable();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) {
    crc = kTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  }
  return ~crc;
}

uint32_t maskedCrc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string frameRecord(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  appendLittleEndian(out, data.size(), 8);
  appendLittleEndian(out, maskedCrc32c(out.data(), 8), 4);
  out += data;
  appendLittleEndian(out, maskedCrc32c(data.data(), data.size()), 4);
  return out;
}

namespace events {

std::string fileVersion(double wallTime) {
  pb::Event event = eventAt(0, wallTime);
  event.set_file_version(kEventFileVersion);
  return serialized(event);
}

std::string scalar(const std::string& tag, float value, int64_t step, double wallTime) {
  pb::Event event = eventAt(step, wallTime);
  pb::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(value);
  return serialized(event);
}

std::string text(const std::string& tag, const std::string& text, int64_t step, double wallTime) {
  pb::Event event = eventAt(step, wallTime);
  pb::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  // What TensorBoard's own text summaries carry: the text plugin's name (its content,
  // TextPluginData version 0, serializes to nothing) and a rank-0 string tensor.
  pb::SummaryMetadata* metadata = v->mutable_metadata();
  metadata->mutable_plugin_data()->set_plugin_name("text");
  metadata->set_data_class(pb::DATA_CLASS_TENSOR);
  pb::TensorProto* tensor = v->mutable_tensor();
  tensor->set_dtype(pb::DT_STRING);
  tensor->mutable_tensor_shape();  // no dims: a scalar
  tensor->add_string_val(text);
  return serialized(event);
}

std::string sessionStart(int64_t step, double wallTime) {
  pb::Event event = eventAt(step, wallTime);
  event.mutable_session_log()->set_status(pb::SessionLog::START);
  return serialized(event);
}

}  // namespace events
}  // namespace train
}  // namespace hddp
