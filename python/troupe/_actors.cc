// troupe._actors: the built-in C++ actors' typed interfaces (actors/schema/*.capnp) for Python.
// encode() turns a method's params, given as a dict, into the Cap'n Proto message that the
// actor's generic call takes for that method (actors/typed_call.h); decode() turns the reply,
// the method's results message, into a dict. Fields are the schema's names (camelCase); Data is
// bytes (any buffer when encoding), Text is str, an enum is its enumerant's name, a list a list,
// a struct a dict. The calls themselves go through troupe's ordinary actor calls (_core).
// Errors: a dict that does not fit the schema (an unknown field, a value out of the field's
// range, a wrong type) raises ValueError or TypeError naming the field; a reply that is not a
// results message raises ValueError.
// Thread-safety: called with the GIL held; holds no state but the compiled-in schemas.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <capnp/dynamic.h>
#include <capnp/serialize.h>
#include <fmt/format.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "checkpoint.capnp.h"
#include "dataloader.capnp.h"
#include "trainer.capnp.h"
#include "python_errors.h"

namespace py = pybind11;
using troupe::python::InvalidArgument;
using troupe::python::WrongType;

namespace troupe::actors {
namespace {

const std::map<std::string, capnp::InterfaceSchema>& interfaces() {
  static const std::map<std::string, capnp::InterfaceSchema> kInterfaces = {
      {"Checkpoint", capnp::Schema::from<rpc::Checkpoint>()},
      {"Dataloader", capnp::Schema::from<rpc::Dataloader>()},
      {"Trainer", capnp::Schema::from<rpc::Trainer>()},
  };
  return kInterfaces;
}

capnp::InterfaceSchema::Method findMethod(const std::string& interface, const std::string& method) {
  auto it = interfaces().find(interface);
  if (it == interfaces().end()) {
    std::string known;
    for (const auto& [name, schema] : interfaces()) known += (known.empty() ? "" : ", ") + name;
    throw InvalidArgument(fmt::format("no typed interface '{}' ({})", interface, known));
  }
  KJ_IF_MAYBE(m, it->second.findMethodByName(method)) { return *m; }
  std::string known;
  for (auto each : it->second.getMethods()) known += (known.empty() ? "" : ", ") + std::string(each.getProto().getName().cStr());
  throw InvalidArgument(fmt::format("{} has no method '{}' ({})", interface, method, known));
}

void fillStruct(capnp::DynamicStruct::Builder out, py::handle value, const std::string& where);

// A scalar, text, data or enum value of `type` from Python (lists and structs are built in place).
capnp::DynamicValue::Reader scalar(py::handle value, capnp::Type type, const std::string& where,
                                   std::string& textHolder, py::buffer_info& bufferHolder) {
  using W = capnp::schema::Type;
  switch (type.which()) {
    case W::BOOL:
      if (!py::isinstance<py::bool_>(value)) throw WrongType(where + ": expected a bool");
      return value.cast<bool>();
    case W::INT8: case W::INT16: case W::INT32: case W::INT64:
      if (!py::isinstance<py::int_>(value)) throw WrongType(where + ": expected an int");
      return value.cast<int64_t>();
    case W::UINT8: case W::UINT16: case W::UINT32: case W::UINT64:
      if (!py::isinstance<py::int_>(value)) throw WrongType(where + ": expected an int");
      if (value.cast<py::int_>() < py::int_(0)) throw InvalidArgument(where + ": must not be negative");
      return value.cast<uint64_t>();
    case W::FLOAT32: case W::FLOAT64:
      return value.cast<double>();
    case W::TEXT:
      if (!py::isinstance<py::str>(value)) throw WrongType(where + ": expected a str");
      textHolder = value.cast<std::string>();
      return capnp::Text::Reader(textHolder.c_str(), textHolder.size());
    case W::DATA: {
      if (!PyObject_CheckBuffer(value.ptr())) throw WrongType(where + ": expected bytes or a buffer");
      bufferHolder = py::reinterpret_borrow<py::buffer>(value).request();
      if (bufferHolder.ndim > 1 && bufferHolder.strides.back() != bufferHolder.itemsize) {
        throw InvalidArgument(where + ": the buffer must be contiguous");
      }
      return capnp::Data::Reader(static_cast<const kj::byte*>(bufferHolder.ptr),
                                 static_cast<size_t>(bufferHolder.size * bufferHolder.itemsize));
    }
    case W::ENUM: {
      auto schema = type.asEnum();
      if (py::isinstance<py::str>(value)) {
        std::string name = value.cast<std::string>();
        KJ_IF_MAYBE(e, schema.findEnumerantByName(name)) { return capnp::DynamicEnum(*e); }
        std::string known;
        for (auto e : schema.getEnumerants()) known += (known.empty() ? "" : ", ") + std::string(e.getProto().getName().cStr());
        throw InvalidArgument(fmt::format("{}: '{}' is not one of {}", where, name, known));
      }
      throw WrongType(where + ": expected the enumerant's name");
    }
    default:
      throw WrongType(where + ": a field of this type cannot be set from Python");
  }
}

void fillList(capnp::DynamicList::Builder out, py::sequence items, const std::string& where) {
  auto element = out.getSchema().getElementType();
  for (size_t i = 0; i < out.size(); ++i) {
    std::string at = fmt::format("{}[{}]", where, i);
    py::handle item = items[i];
    if (element.isStruct()) {
      fillStruct(out[i].as<capnp::DynamicStruct>(), item, at);
    } else if (element.isList()) {
      auto inner = py::reinterpret_borrow<py::sequence>(item);
      fillList(out.init(i, py::len(inner)).as<capnp::DynamicList>(), inner, at);
    } else {
      std::string text;
      py::buffer_info buffer;
      out.set(i, scalar(item, element, at, text, buffer));
    }
  }
}

void fillStruct(capnp::DynamicStruct::Builder out, py::handle value, const std::string& where) {
  if (!py::isinstance<py::dict>(value)) throw WrongType(where + ": expected a dict");
  auto schema = out.getSchema();
  for (auto [key, item] : py::reinterpret_borrow<py::dict>(value)) {
    std::string name = py::str(key);
    std::string at = where + "." + name;
    KJ_IF_MAYBE(field, schema.findFieldByName(name)) {
      auto type = field->getType();
      if (type.isStruct()) {
        fillStruct(out.init(*field).as<capnp::DynamicStruct>(), item, at);
      } else if (type.isList()) {
        if (!py::isinstance<py::sequence>(item) || py::isinstance<py::str>(item)) throw WrongType(at + ": expected a list");
        auto items = py::reinterpret_borrow<py::sequence>(item);
        fillList(out.init(*field, py::len(items)).as<capnp::DynamicList>(), items, at);
      } else {
        std::string text;
        py::buffer_info buffer;
        out.set(*field, scalar(item, type, at, text, buffer));
      }
      continue;
    }
    std::string known;
    for (auto f : schema.getFields()) known += (known.empty() ? "" : ", ") + std::string(f.getProto().getName().cStr());
    throw InvalidArgument(fmt::format("{}: no field '{}' ({})", where, name, known));
  }
}

py::object toPython(capnp::DynamicValue::Reader value);

py::dict structToPython(capnp::DynamicStruct::Reader r) {
  py::dict out;
  for (auto field : r.getSchema().getNonUnionFields()) {
    out[field.getProto().getName().cStr()] = toPython(r.get(field));
  }
  KJ_IF_MAYBE(which, r.which()) { out[which->getProto().getName().cStr()] = toPython(r.get(*which)); }
  return out;
}

py::object toPython(capnp::DynamicValue::Reader value) {
  switch (value.getType()) {
    case capnp::DynamicValue::VOID: return py::none();
    case capnp::DynamicValue::BOOL: return py::bool_(value.as<bool>());
    case capnp::DynamicValue::INT: return py::int_(value.as<int64_t>());
    case capnp::DynamicValue::UINT: return py::int_(value.as<uint64_t>());
    case capnp::DynamicValue::FLOAT: return py::float_(value.as<double>());
    case capnp::DynamicValue::TEXT: {
      auto t = value.as<capnp::Text>();
      return py::str(t.cStr(), t.size());
    }
    case capnp::DynamicValue::DATA: {
      auto d = value.as<capnp::Data>();
      return py::bytes(reinterpret_cast<const char*>(d.begin()), d.size());
    }
    case capnp::DynamicValue::LIST: {
      auto list = value.as<capnp::DynamicList>();
      py::list out(list.size());
      for (size_t i = 0; i < list.size(); ++i) out[i] = toPython(list[i]);
      return out;
    }
    case capnp::DynamicValue::ENUM: {
      auto e = value.as<capnp::DynamicEnum>();
      KJ_IF_MAYBE(known, e.getEnumerant()) { return py::str(known->getProto().getName().cStr()); }
      return py::int_(e.getRaw());  // a newer peer's enumerant
    }
    case capnp::DynamicValue::STRUCT: return structToPython(value.as<capnp::DynamicStruct>());
    default: return py::none();
  }
}

py::bytes encode(const std::string& interface, const std::string& method, py::dict params) {
  auto m = findMethod(interface, method);
  capnp::MallocMessageBuilder message;
  try {
    fillStruct(message.initRoot<capnp::DynamicStruct>(m.getParamType()), params, interface + "." + method);
  } catch (const kj::Exception& e) {  // e.g. a value out of its field's range
    throw InvalidArgument(fmt::format("{}.{}: {}", interface, method, e.getDescription().cStr()));
  }
  auto flat = capnp::messageToFlatArray(message);
  auto bytes = flat.asBytes();
  return py::bytes(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

py::dict decode(const std::string& interface, const std::string& method, py::buffer reply) {
  auto m = findMethod(interface, method);
  py::buffer_info info = reply.request();
  size_t size = static_cast<size_t>(info.size * info.itemsize);
  if (size % sizeof(capnp::word) != 0) {
    throw InvalidArgument(fmt::format("{}.{}: the reply is {} bytes, not whole 8-byte words: not a results message",
                                      interface, method, size));
  }
  auto words = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
  if (size > 0) std::memcpy(words.begin(), info.ptr, size);
  try {
    capnp::ReaderOptions options;
    options.traversalLimitInWords = std::max<uint64_t>(options.traversalLimitInWords, 2 * words.size());
    capnp::FlatArrayMessageReader message(words, options);
    KJ_REQUIRE(message.getEnd() == words.end(), "bytes after the message");
    return structToPython(message.getRoot<capnp::DynamicStruct>(m.getResultType()));
  } catch (const kj::Exception& e) {
    throw InvalidArgument(fmt::format("{}.{}: the reply is not a results message: {}", interface, method,
                                      e.getDescription().cStr()));
  }
}

std::vector<std::string> methods(const std::string& interface) {
  auto it = interfaces().find(interface);
  if (it == interfaces().end()) throw InvalidArgument(fmt::format("no typed interface '{}'", interface));
  std::vector<std::string> out;
  for (auto m : it->second.getMethods()) out.emplace_back(m.getProto().getName().cStr());
  return out;
}

}  // namespace
}  // namespace troupe::actors

PYBIND11_MODULE(_actors, m) {
  troupe::python::registerErrors();
  m.doc() = "The built-in C++ actors' typed interfaces: params and results as Cap'n Proto messages";
  m.def("encode", &troupe::actors::encode, py::arg("interface"), py::arg("method"), py::arg("params"));
  m.def("decode", &troupe::actors::decode, py::arg("interface"), py::arg("method"), py::arg("reply"));
  m.def("methods", &troupe::actors::methods, py::arg("interface"));
}
