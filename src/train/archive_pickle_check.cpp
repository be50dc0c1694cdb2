// A pickle of a LibTorch archive run by a machine that builds no values, only what
// LibTorch's unpickler (torch/csrc/jit/serialization/unpickler.cpp) would trust of them
// (train/archive_check.h). It knows the opcodes that unpickler knows and does what it does
// with each, with the checks it leaves out: every length within the bytes left, memo
// indices below the pickle's size, no value taken from below the innermost MARK (the
// unpickler's stack would then underflow), pairs for a dict, a global's index where a
// callable is, nesting bounded, each storage against its record and each tensor against
// its storage. Stricter than LibTorch only where hddp's archives never go: the callables
// a quantized, sparse or subclassed tensor needs are refused.
#include <cstdio>
#include <vector>

#include "train/archive_check.h"
#include "train/archive_pickle_machine.h"

namespace hddp {
namespace train {
namespace archive_pickle {

void ArchivePickleMachine::run() {
  check(p_.size() >= 2 && byte() == 0x80 && byte() == 2, 0,
        "it does not begin with PROTO 2, the only protocol LibTorch's unpickler reads");
  while (true) {
    const size_t at = pos_;
    const uint8_t op = byte();
    switch (op) {
      case ']':
        push(make(Kind::List));
        break;
      case ')':
        push(make(Kind::Tuple));
        break;
      case '}':
        push(make(Kind::Dict));
        break;
      case 'q':  // BINPUT
        memoize(byte(), at);
        break;
      case 'r':  // LONG_BINPUT
        memoize(u32(), at);
        break;
      case '(':  // MARK
        marks_.push_back(stack_.size());
        break;
      case 0x88:  // NEWTRUE
      case 0x89:  // NEWFALSE
        push(number(Kind::Bool, op == 0x88));
        break;
      case 'N':
        push(make(Kind::None));
        break;
      case 'K':  // BININT1
        push(number(Kind::Int, byte()));
        break;
      case 'M': {  // BININT2
        const uint8_t low = byte();
        push(number(Kind::Int, low | (byte() << 8)));
        break;
      }
      case 'J':  // BININT
        push(number(Kind::Int, static_cast<int32_t>(u32())));
        break;
      case 0x8a: {  // LONG1, which LibTorch reads only 8 bytes long
        check(byte() == 8, at, "a LONG1 of another length than 8 bytes");
        uint64_t v = 0;
        std::memcpy(&v, take(8, at), 8);
        push(number(Kind::Int, static_cast<int64_t>(v)));
        break;
      }
      case 'X': {  // BINUNICODE
        const uint32_t n = u32();
        const char* chars = take(n, at);
        const uint32_t v = make(Kind::String);
        values_[v].s.assign(chars, n);
        push(v);
        break;
      }
      case 'G':  // BINFLOAT
        take(8, at);
        push(make(Kind::Float));
        break;
      case 't':  // TUPLE
        push(tuple(popToMark(at), at));
        break;
      case 0x85:  // TUPLE1, TUPLE2, TUPLE3
      case 0x86:
      case 0x87: {
        std::vector<uint32_t> items(static_cast<size_t>(op - 0x84));
        for (size_t k = items.size(); k-- > 0;) {
          items[k] = pop(at);
        }
        push(tuple(std::move(items), at));
        break;
      }
      case 'e':  // APPENDS, to the list below the MARK
        grow(Kind::List, popToMark(at), at);
        break;
      case 'l': {  // LIST
        const auto items = popToMark(at);
        push(make(Kind::List));
        grow(Kind::List, items, at);
        break;
      }
      case 'd': {  // DICT
        const auto items = popToMark(at);
        push(make(Kind::Dict));
        grow(Kind::Dict, items, at);
        break;
      }
      case 'u':  // SETITEMS, to the dict below the MARK
        grow(Kind::Dict, popToMark(at), at);
        break;
      case 's': {  // SETITEM
        const uint32_t value = pop(at);
        const uint32_t key = pop(at);
        grow(Kind::Dict, {key, value}, at);
        break;
      }
      case 'h':  // BINGET
        push(recall(byte(), at));
        break;
      case 'j':  // LONG_BINGET
        push(recall(u32(), at));
        break;
      case 'c': {  // GLOBAL
        const std::string module = line(at);
        push(global(module, line(at), at));
        break;
      }
      case 0x81:  // NEWOBJ: its (empty) arguments go; the class stays for BUILD
        pop(at);
        break;
      case 'R':  // REDUCE and BUILD: LibTorch calls the global below the argument
      case 'b': {
        const uint32_t argument = pop(at);
        push(call(pop(at), argument, at));
        break;
      }
      case 'Q':  // BINPERSID
        push(storage(pop(at), at));
        break;
      case '.':  // STOP
        check(stack_.size() == 1, at, "it stops with ", stack_.size(),
              " values on its stack instead of one");
        return;
      default: {
        char code[8];
        std::snprintf(code, sizeof(code), "0x%02x", op);
        fail(at, "opcode ", code, " is not one LibTorch's unpickler reads");
      }
    }
  }
}

}  // namespace archive_pickle

void checkArchivePickle(
    const std::string& pickle, const std::string& name, const std::string& tensorDir,
    const std::function<std::optional<uint64_t>(const std::string&)>& recordSize,
    uint64_t& storageBudget, const std::string& what) {
  checkPickleSize(pickle.size(), name, what);
  archive_pickle::ArchivePickleMachine(pickle, name, tensorDir, recordSize, storageBudget, what)
      .run();
}

}  // namespace train
}  // namespace hddp
