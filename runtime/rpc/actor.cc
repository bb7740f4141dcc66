#include "troupe/runtime/actor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace troupe {

void ActorRegistry::add(std::string type, ActorFactory factory) { factories_[std::move(type)] = std::move(factory); }

Result<std::unique_ptr<Actor>> ActorRegistry::create(const ActorContext& context, std::string_view initArgs) const {
  auto it = factories_.find(context.type);
  if (it == factories_.end()) {
    return Status(StatusCode::kNotFound, fmt::format("unknown actor type '{}' (this worker knows: {})", context.type,
                                                     fmt::join(types(), ", ")));
  }
  return it->second(context, initArgs);
}

std::vector<std::string> ActorRegistry::types() const {
  std::vector<std::string> out;
  for (const auto& [name, factory] : factories_) out.push_back(name);
  return out;
}

}  // namespace troupe
