#include <iostream>
#include <set>
#include <string_view>

#include "cli.h"
#include "troupe/runtime/names.h"
#include "troupe/runtime/rpc.h"

namespace troupe::cli {

int logsCommand(const std::string& actor, const std::string& address, const std::string& token, size_t maxBytes) {
  // An id, an id prefix (4+ hex digits) or a name ("NAME" or "NAMESPACE/NAME"), checked before any
  // lookup: '' would match an unnamed actor.
  if (actor.empty()) {
    return fail(Status(StatusCode::kInvalidArgument, "name an actor: its id, an id prefix or its name (see 'troupe status')"));
  }
  bool hex = actor.find_first_not_of("0123456789abcdef") == std::string::npos;
  if (!hex) {
    if (auto s = checkScopedName(actor); !s.isOk()) return fail(s);
  }
  auto target = resolveCluster(address, token);
  if (!target.isOk()) return fail(target.status());
  auto io = kj::setupAsyncIo();
  auto snapshot = fetchStatus(io, *target, 3 * kj::SECONDS);
  if (!snapshot.isOk()) return fail(snapshot.status());
  const ActorRecord* found = nullptr;
  for (const auto& a : snapshot->actors) {
    bool match = a.id.hex() == actor || (!a.name.empty() && a.name == actor) ||
                 (hex && actor.size() >= 4 && a.id.hex().rfind(actor, 0) == 0);
    if (match && (!found || a.state != ActorState::kDead)) found = &a;
  }
  if (!found && !hex && actor.find('/') == std::string::npos) {
    // A plain NAME of a driver's anonymous namespace ("anonymous-.../NAME"), or any other one,
    // when only one namespace has it.
    std::set<std::string> names;
    for (const auto& a : snapshot->actors) {
      size_t slash = a.name.rfind('/');
      if (slash == std::string::npos || std::string_view(a.name).substr(slash + 1) != actor) continue;
      names.insert(a.name);
      if (!found || a.state != ActorState::kDead) found = &a;
    }
    if (names.size() > 1) {
      std::string all;
      for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
      return fail(Status(StatusCode::kInvalidArgument,
                         fmt::format("'{}' names actors in {} namespaces ({}): say which, as NAMESPACE/NAME", actor,
                                     names.size(), all)));
    }
  }
  if (!found) return fail(Status(StatusCode::kNotFound, fmt::format("no actor with id or name '{}' (see 'troupe status')", actor)));
  const NodeRecord* node = nullptr;
  for (const auto& n : snapshot->nodes) {
    if (n.id == found->nodeId) node = &n;
  }
  if (!node) return fail(Status(StatusCode::kNotFound, fmt::format("actor {} has not run on any node yet", found->id.hex())));
  auto nodeAddress = parseHostPort(node->address);
  if (!nodeAddress.isOk()) return fail(nodeAddress.status());
  std::string out, err;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    auto client = RpcClient::connect(io, *nodeAddress, target->token, 3 * kj::SECONDS).wait(io.waitScope);
    auto request = client->bootstrap<rpc::NodeAgent>().readLogsRequest();
    request.setId(found->id.hex());
    request.setMaxBytes(static_cast<uint32_t>(maxBytes));
    // A deadline: a node cut off but not yet declared DEAD must not hold the command.
    auto response = io.provider->getTimer().timeoutAfter(10 * kj::SECONDS, request.send()).wait(io.waitScope);
    out.assign(reinterpret_cast<const char*>(response.getStdout().begin()), response.getStdout().size());
    err.assign(reinterpret_cast<const char*>(response.getStderr().begin()), response.getStderr().size());
  })) {
    return fail(statusFromException(*e, fmt::format("cannot read the logs from node {} ({})", node->id.hex(),
                                                    node->state == NodeState::kDead ? "it is dead" : node->address)));
  }
  std::cout << "== actor " << found->id.hex() << " (" << found->type << ") stdout\n" << out;
  if (!out.empty() && out.back() != '\n') std::cout << '\n';
  std::cout << "== stderr\n" << err;
  if (!err.empty() && err.back() != '\n') std::cout << '\n';
  std::cout.flush();
  return 0;
}

}  // namespace troupe::cli
