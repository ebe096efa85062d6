//! The integration tests that can share a process, one binary with a module per area. They
//! start real `retrace serve` processes (the binary this package builds) or the server
//! in-process on 127.0.0.1:0, with the fakes of `common/` only where a real part can't run here.
//! `overload`, `sigterm` and `unreadable` read or change process-wide state, so each is a binary
//! of its own. Metrics are process-wide too: a test that reads one names an evaluator no other
//! test uses.
// A test crate's helpers are `pub` for its modules, not an API: nothing outside reaches them.
#![allow(unreachable_pub)]

mod bench;
mod cli;
mod code_shape;
mod common;
mod connections;
mod dead_model;
mod eval;
mod fuzz_props;
mod gguf;
mod guarantee;
mod head;
mod http;
mod judge_faults;
mod judge_llama;
mod judge_output;
mod judge_replies;
mod judge_wire;
mod label;
mod learn;
mod memory;
mod outcome;
mod prm;
mod reliability;
mod replicas;
mod score;
mod service;
mod smollm2;
mod train;
mod trainers;
mod vllm;
