#include "troupe/actors/test_actors.h"

#include <signal.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <thread>

#include <fmt/format.h>

#include "troupe.capnp.h"
#include "troupe/actors/init_args.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/rpc.h"

namespace troupe::actors {
namespace {

Result<int64_t> parseInt(std::string_view text, const char* what) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    return Status(StatusCode::kInvalidArgument, fmt::format("{} must be an integer, got '{}'", what, text));
  }
  return value;
}

// Answers the methods every test actor shares.
class TestActor : public Actor {
 public:
  explicit TestActor(ActorContext context) : context_(std::move(context)) {}

  Result<std::string> call(const std::string& method, std::string_view payload) override {
    if (method == "whoami") {
      return fmt::format("{} {} {} {}", context_.type, context_.id.hex(), context_.incarnation, getpid());
    }
    return handle(method, payload);
  }

 protected:
  virtual Result<std::string> handle(const std::string& method, std::string_view payload) = 0;
  Status unknown(const std::string& method) const {
    return Status(StatusCode::kInvalidArgument, fmt::format("{} has no method '{}'", context_.type, method));
  }
  ActorContext context_;
};

class Counter final : public TestActor {
 public:
  Counter(ActorContext context, int64_t start) : TestActor(std::move(context)), value_(std::make_shared<int64_t>(start)) {}

  kj::Maybe<capnp::Capability::Client> typed() override {
    return capnp::Capability::Client(kj::heap<TypedCounter>(value_));
  }

 protected:
  Result<std::string> handle(const std::string& method, std::string_view payload) override {
    if (method == "add") {
      TROUPE_ASSIGN_OR_RETURN(auto delta, parseInt(payload, "the delta"));
      *value_ += delta;
      return std::to_string(*value_);
    }
    if (method == "get") return std::to_string(*value_);
    return unknown(method);
  }

 private:
  // The typed interface shares the value with the generic one: both are the same counter. (Its
  // schema is the runtime's troupe.capnp: troupe::rpc, not the actors' rpc namespace.)
  class TypedCounter final : public troupe::rpc::Counter::Server {
   public:
    explicit TypedCounter(std::shared_ptr<int64_t> value) : value_(std::move(value)) {}

   protected:
    kj::Promise<void> add(AddContext context) override {
      *value_ += context.getParams().getDelta();
      context.getResults().setValue(*value_);
      return kj::READY_NOW;
    }
    kj::Promise<void> get(GetContext context) override {
      context.getResults().setValue(*value_);
      return kj::READY_NOW;
    }

   private:
    std::shared_ptr<int64_t> value_;
  };

  std::shared_ptr<int64_t> value_;
};

class Echo final : public TestActor {
 public:
  using TestActor::TestActor;

 protected:
  Result<std::string> handle(const std::string& method, std::string_view payload) override {
    if (method == "echo") return std::string(payload);
    if (method == "size") return std::to_string(payload.size());
    return unknown(method);
  }
};

class Sleeper final : public TestActor {
 public:
  using TestActor::TestActor;

 protected:
  Result<std::string> handle(const std::string& method, std::string_view payload) override {
    if (method != "sleep") return unknown(method);
    TROUPE_ASSIGN_OR_RETURN(auto ms, parseInt(payload, "the sleep in milliseconds"));
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));  // the point of this actor
    return std::string("slept");
  }
};

class Crasher final : public TestActor {
 public:
  using TestActor::TestActor;

 protected:
  Result<std::string> handle(const std::string& method, std::string_view payload) override {
    if (method == "ping") return std::string("pong");
    if (method == "fail") return Status(StatusCode::kFailedPrecondition, "Crasher failed on purpose");
    if (method == "segfault") {
      fprintf(stderr, "Crasher: about to dereference a null pointer\n");
      fflush(stderr);
      raise(SIGSEGV);
    }
    if (method == "abort") {
      fprintf(stderr, "Crasher: aborting\n");
      fflush(stderr);
      abort();
    }
    if (method == "exit") {
      auto code = parseInt(payload, "the exit code");
      fprintf(stderr, "Crasher: exiting with code %lld\n", static_cast<long long>(code.isOk() ? *code : 1));
      fflush(stderr);
      _exit(code.isOk() ? static_cast<int>(*code) : 1);
    }
    return unknown(method);
  }
};

// Calls another actor whose id it is given: handles travel between actors as ids.
class Relay final : public TestActor {
 public:
  using TestActor::TestActor;

  kj::Promise<Result<std::string>> callAsync(const std::string& method, std::string_view payload) override {
    if (method != "relay") return call(method, payload);
    // payload: "<actor id> <method> <payload...>"
    auto first = payload.find(' ');
    auto second = first == std::string::npos ? first : payload.find(' ', first + 1);
    if (second == std::string::npos || context_.cluster == nullptr) {
      return Result<std::string>(Status(StatusCode::kInvalidArgument, "relay needs '<actor id> <method> <payload>'"));
    }
    auto target = context_.cluster->actor(ActorId(std::string(payload.substr(0, first))));
    return target.call(std::string(payload.substr(first + 1, second - first - 1)), std::string(payload.substr(second + 1)))
        .then([](std::string reply) { return Result<std::string>(std::move(reply)); },
              [](kj::Exception&& e) { return Result<std::string>(statusFromException(e, "relay")); });
  }

 protected:
  Result<std::string> handle(const std::string& method, std::string_view) override { return unknown(method); }
};

}  // namespace

void registerTestActors(ActorRegistry& registry) {
  registry.add("Relay", [](const ActorContext& context, std::string_view) -> Result<std::unique_ptr<Actor>> {
    return std::unique_ptr<Actor>(std::make_unique<Relay>(context));
  });
  registry.add("Counter", [](const ActorContext& context, std::string_view args) -> Result<std::unique_ptr<Actor>> {
    TROUPE_ASSIGN_OR_RETURN(auto init, decodeInitArgs<rpc::CounterArgs>("Counter", args));
    return std::unique_ptr<Actor>(std::make_unique<Counter>(context, init.get().getStart()));
  });
  registry.add("Echo", [](const ActorContext& context, std::string_view) -> Result<std::unique_ptr<Actor>> {
    return std::unique_ptr<Actor>(std::make_unique<Echo>(context));
  });
  registry.add("Sleeper", [](const ActorContext& context, std::string_view) -> Result<std::unique_ptr<Actor>> {
    return std::unique_ptr<Actor>(std::make_unique<Sleeper>(context));
  });
  registry.add("Crasher", [](const ActorContext& context, std::string_view args) -> Result<std::unique_ptr<Actor>> {
    TROUPE_ASSIGN_OR_RETURN(auto init, decodeInitArgs<rpc::CrasherArgs>("Crasher", args));
    if (init.get().getFailOnStart()) {
      return Status(StatusCode::kFailedPrecondition, "Crasher refused to start (fail_on_start)");
    }
    return std::unique_ptr<Actor>(std::make_unique<Crasher>(context));
  });
}

}  // namespace troupe::actors
