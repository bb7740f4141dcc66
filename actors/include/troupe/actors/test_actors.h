// Built-in test actors, used by tests, benchmarks and the demo:
//   Counter  "add" (payload: decimal delta) -> new value; "get" -> value; typed rpc::Counter.
//            initArgs: rpc::CounterArgs (actors/schema/init_args.capnp), e.g. {"start": 7}.
//   Echo     "echo" -> the payload unchanged; "size" -> payload length.
//   Sleeper  "sleep" (payload: milliseconds) -> "slept"; blocks its worker meanwhile.
//   Crasher  "segfault" writes a line to stderr then dies of SIGSEGV; "abort" dies of SIGABRT;
//            "exit" (payload: code) exits; "fail" returns an error; "ping" -> "pong".
//            initArgs rpc::CrasherArgs: {"fail_on_start": true} makes construction fail.
//   Relay    "relay" (payload: "<actor id> <method> <payload>") calls that actor and returns its
//            reply: a handle passed to another actor (as its id).
// Every reply also answers "whoami" with "<type> <actor id> <incarnation> <pid>".
// Thread-safety: see troupe/runtime/actor.h.
#pragma once

#include "troupe/runtime/actor.h"

namespace troupe::actors {

void registerTestActors(ActorRegistry& registry);

}  // namespace troupe::actors
