#include "troupe/actors/init_args.h"

#include <capnp/compat/json.h>
#include <capnp/dynamic.h>
#include <capnp/schema.h>
#include <capnp/serialize.h>
#include <fmt/format.h>
#include <kj/array.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <vector>

namespace troupe::actors {
namespace {

// $Json.name (capnp/compat/json.capnp): a field's JSON key when it is not the field's own name.
constexpr uint64_t kJsonNameAnnotation = 0xfa5b1fd61c2e7c3dull;

// Init args are a few hundred bytes: far smaller bounds than a reader's defaults (64 MiB words,
// 64 levels) leave no room for a message that makes its reader work.
constexpr uint64_t kMaxWords = 1 << 20;  // 8 MiB
constexpr int kMaxNesting = 16;

// Reads every field as the schema types it. Copying a message checks each pointer's bounds, not
// its kind: a struct where text is expected would throw in the actor that reads it, not here.
void readAll(capnp::DynamicValue::Reader value) {
  switch (value.getType()) {
    case capnp::DynamicValue::STRUCT: {
      auto fields = value.as<capnp::DynamicStruct>();
      for (auto field : fields.getSchema().getNonUnionFields()) readAll(fields.get(field));
      KJ_IF_MAYBE(active, fields.which()) { readAll(fields.get(*active)); }
      break;
    }
    case capnp::DynamicValue::LIST:
      for (auto element : value.as<capnp::DynamicList>()) readAll(element);
      break;
    default:
      break;
  }
}

const std::map<std::string_view, capnp::StructSchema>& table() {
  static const auto* types = new std::map<std::string_view, capnp::StructSchema>{
      {"Trainer", capnp::Schema::from<rpc::TrainerArgs>()},
      {"Dataloader", capnp::Schema::from<rpc::DataloaderArgs>()},
      {"Checkpoint", capnp::Schema::from<rpc::CheckpointArgs>()},
      {"Counter", capnp::Schema::from<rpc::CounterArgs>()},
      {"Crasher", capnp::Schema::from<rpc::CrasherArgs>()},
  };
  return *types;
}

std::string jsonName(const capnp::StructSchema::Field& field) {
  for (auto annotation : field.getProto().getAnnotations()) {
    if (annotation.getId() == kJsonNameAnnotation) return annotation.getValue().getText().cStr();
  }
  return field.getProto().getName().cStr();
}

const char* jsonKind(capnp::JsonValue::Reader value) {
  switch (value.which()) {
    case capnp::JsonValue::NULL_: return "null";
    case capnp::JsonValue::BOOLEAN: return "a boolean";
    case capnp::JsonValue::NUMBER: return "a number";
    case capnp::JsonValue::STRING: return "a string";
    case capnp::JsonValue::ARRAY: return "an array";
    case capnp::JsonValue::OBJECT: return "an object";
    case capnp::JsonValue::CALL: return "a call";
  }
  return "an unknown value";
}

// Checks a JSON value against a field's type before JsonCodec decodes it: the codec ignores
// unknown keys, reads strings as numbers and names neither the type nor the field in its errors.
class Checker {
 public:
  explicit Checker(std::string_view type) : type_(type) {}

  Status structure(capnp::JsonValue::Reader value, capnp::StructSchema schema, const std::string& path) {
    if (value.which() != capnp::JsonValue::OBJECT) {
      return wrong(path, fmt::format("an object of the fields of {}", schema.getUnqualifiedName().cStr()), value);
    }
    std::map<std::string, capnp::StructSchema::Field> fields;
    for (auto field : schema.getFields()) fields.emplace(jsonName(field), field);
    std::set<std::string> seen;
    int unionMembers = 0;
    for (auto entry : value.getObject()) {
      std::string key = entry.getName().cStr();
      std::string at = path.empty() ? key : path + "." + key;
      auto it = fields.find(key);
      if (it == fields.end()) {
        std::vector<std::string> known;
        for (const auto& [name, field] : fields) known.push_back(name);
        return bad(fmt::format("unknown field \"{}\" ({} has: {})", at, schema.getUnqualifiedName().cStr(),
                               fmt::join(known, ", ")));
      }
      if (!seen.insert(key).second) return bad(fmt::format("field \"{}\" is given twice", at));
      if (it->second.getProto().getDiscriminantValue() != capnp::schema::Field::NO_DISCRIMINANT &&
          ++unionMembers > 1) {
        return bad(fmt::format("field \"{}\": only one of a union's fields may be given", at));
      }
      TROUPE_RETURN_IF_ERROR(check(entry.getValue(), it->second.getType(), at));
    }
    return Status::ok();
  }

 private:
  Status check(capnp::JsonValue::Reader value, capnp::Type type, const std::string& path) {
    if (++depth_ > kMaxNesting) return bad(fmt::format("\"{}\" is nested more than {} deep", path, kMaxNesting));
    Status s = checkValue(value, type, path);
    --depth_;
    return s;
  }

  Status checkValue(capnp::JsonValue::Reader value, capnp::Type type, const std::string& path) {
    using capnp::JsonValue;
    switch (type.which()) {
      case capnp::schema::Type::BOOL:
        return value.which() == JsonValue::BOOLEAN ? Status::ok() : wrong(path, "a boolean", value);
      case capnp::schema::Type::INT8: return integer<int8_t>(value, path);
      case capnp::schema::Type::INT16: return integer<int16_t>(value, path);
      case capnp::schema::Type::INT32: return integer<int32_t>(value, path);
      case capnp::schema::Type::INT64: return integer<int64_t>(value, path);
      case capnp::schema::Type::UINT8: return integer<uint8_t>(value, path);
      case capnp::schema::Type::UINT16: return integer<uint16_t>(value, path);
      case capnp::schema::Type::UINT32: return integer<uint32_t>(value, path);
      case capnp::schema::Type::UINT64: return integer<uint64_t>(value, path);
      case capnp::schema::Type::FLOAT32:
      case capnp::schema::Type::FLOAT64:
        return value.which() == JsonValue::NUMBER ? Status::ok() : wrong(path, "a number", value);
      case capnp::schema::Type::TEXT:
        return value.which() == JsonValue::STRING ? Status::ok() : wrong(path, "a string", value);
      case capnp::schema::Type::ENUM: {
        if (value.which() != JsonValue::STRING) return wrong(path, "a string", value);
        auto name = value.getString();
        KJ_IF_MAYBE(e, type.asEnum().findEnumerantByName(name)) {
          (void)e;
          return Status::ok();
        }
        return bad(fmt::format("\"{}\" is \"{}\", not one of {}'s values", path, name.cStr(),
                               type.asEnum().getUnqualifiedName().cStr()));
      }
      case capnp::schema::Type::LIST: {
        if (value.which() != JsonValue::ARRAY) return wrong(path, "an array", value);
        auto element = type.asList().getElementType();
        auto items = value.getArray();
        for (uint i = 0; i < items.size(); ++i) {
          TROUPE_RETURN_IF_ERROR(check(items[i], element, fmt::format("{}[{}]", path, i)));
        }
        return Status::ok();
      }
      case capnp::schema::Type::STRUCT: return structure(value, type.asStruct(), path);
      default:
        return bad(fmt::format("\"{}\" has a type init args cannot carry", path));
    }
  }

  template <typename T>
  Status integer(capnp::JsonValue::Reader value, const std::string& path) {
    if (value.which() != capnp::JsonValue::NUMBER) return wrong(path, "an integer", value);
    double v = value.getNumber();
    // The bounds as doubles: 2^63 and 2^64 are exact; max() of the 64-bit types rounds up to them.
    double lo = static_cast<double>(std::numeric_limits<T>::min());
    double hi = static_cast<double>(std::numeric_limits<T>::max());
    bool inRange = std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t> ? v >= lo && v < hi : v >= lo && v <= hi;
    if (!std::isfinite(v) || std::trunc(v) != v) {
      return bad(fmt::format("\"{}\" must be an integer, got {}", path, v));
    }
    if (!inRange) {
      return bad(fmt::format("\"{}\" is {}, outside [{}, {}]", path, v, std::numeric_limits<T>::min(),
                             std::numeric_limits<T>::max()));
    }
    return Status::ok();
  }

  Status wrong(const std::string& path, std::string_view want, capnp::JsonValue::Reader got) const {
    if (path.empty()) return bad(fmt::format("must be {}, got {}", want, jsonKind(got)));
    return bad(fmt::format("\"{}\" must be {}, got {}", path, want, jsonKind(got)));
  }

  Status bad(const std::string& what) const {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} init args: {} (actors/schema/init_args.capnp)", type_, what));
  }

  std::string_view type_;
  int depth_ = 0;
};

}  // namespace

kj::Maybe<capnp::StructSchema> initArgsSchema(std::string_view type) {
  auto it = table().find(type);
  if (it == table().end()) return nullptr;
  return it->second;
}

Result<std::string> encodeInitArgs(std::string_view type, std::string_view json) {
  KJ_IF_MAYBE(schema, initArgsSchema(type)) {
    if (json.find_first_not_of(" \t\r\n") == std::string_view::npos) json = "{}";
    auto invalid = [type](const std::string& what) {
      return Status(StatusCode::kInvalidArgument, fmt::format("{} init args: {}", type, what));
    };
    capnp::JsonCodec codec;
    codec.setMaxNestingDepth(kMaxNesting);
    codec.setRejectUnknownFields(true);
    codec.handleByAnnotation(*schema);
    capnp::MallocMessageBuilder parsed;
    auto value = parsed.initRoot<capnp::JsonValue>();
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { codec.decodeRaw(kj::ArrayPtr<const char>(json.data(), json.size()), value); })) {
      // KJ's description starts with the failed check; its last part says what was wrong.
      std::string why = e->getDescription().cStr();
      if (auto at = why.rfind("; "); at != std::string::npos) why = why.substr(at + 2);
      return invalid(fmt::format("not valid JSON ({}); they are a JSON object of the fields of {}", why,
                                 schema->getUnqualifiedName().cStr()));
    }
    TROUPE_RETURN_IF_ERROR(Checker(type).structure(value.asReader(), *schema, ""));
    capnp::MallocMessageBuilder message;
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
                  codec.decode(value.asReader(), message.initRoot<capnp::DynamicStruct>(*schema));
                })) {
      return invalid(e->getDescription().cStr());
    }
    return initArgsBytes(message);
  }
  return std::string(json);
}

std::string initArgsBytes(capnp::MessageBuilder& message) {
  auto words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

Result<std::unique_ptr<capnp::MallocMessageBuilder>> copyInitArgs(std::string_view type, capnp::StructSchema schema,
                                                                  std::string_view bytes) {
  auto copy = std::make_unique<capnp::MallocMessageBuilder>();
  if (bytes.empty()) {
    copy->initRoot<capnp::DynamicStruct>(schema);
    return copy;
  }
  auto invalid = [type, schema, size = bytes.size()](const std::string& what) {
    return Status(StatusCode::kInvalidArgument, fmt::format("{} init args ({} bytes) are not a {} message: {}", type,
                                                            size, schema.getUnqualifiedName().cStr(), what));
  };
  if (bytes.size() % sizeof(capnp::word) != 0) {
    return invalid("not a whole number of 8-byte words");
  }
  if (bytes.size() / sizeof(capnp::word) > kMaxWords) {
    return invalid(fmt::format("more than init args may hold ({} bytes)", kMaxWords * sizeof(capnp::word)));
  }
  // The reader needs word alignment, which a std::string's bytes need not have.
  auto words = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  capnp::ReaderOptions options;
  options.traversalLimitInWords = kMaxWords;
  options.nestingLimit = kMaxNesting;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
                capnp::FlatArrayMessageReader reader(words, options);
                if (reader.getEnd() != words.end()) {
                  KJ_FAIL_REQUIRE("bytes after the message", words.end() - reader.getEnd());
                }
                // Copying reads every pointer of the message, each checked against its segment;
                // reading every field then checks that each pointer is of its field's kind.
                copy->setRoot(reader.getRoot<capnp::DynamicStruct>(schema));
                readAll(copy->getRoot<capnp::DynamicStruct>(schema).asReader());
              })) {
    return invalid(e->getDescription().cStr());
  }
  return copy;
}

}  // namespace troupe::actors
