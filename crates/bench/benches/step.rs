//! Figure 1 with divan: one turn of K tool steps (K + 1 model steps) per
//! sample, on a single-threaded tokio runtime, the machine built outside the
//! timing. divan's `item/s` column is steps per second, so its time per item
//! is the framework's cost per step, averaged over the turn; the binary
//! (`src/main.rs`) adds the per-step median.
//!
//! Run with `cargo bench -p markov-bench --bench step` (or `cargo xtask bench`).

use divan::Bencher;
use divan::counter::ItemsCount;
use markov_bench::{Scenario, current_thread_runtime, run_turn};

fn main() {
    divan::main();
}

/// One turn of `k` tool steps and the final answer.
#[divan::bench(args = [10, 100, 1_000, 10_000], sample_size = 1, max_time = 4)]
fn turn(bencher: Bencher, k: usize) {
    let scenario = Scenario::new();
    let runtime = current_thread_runtime();
    bencher
        .counter(ItemsCount::new(k + 1))
        .with_inputs(|| scenario.machine(k))
        // The machine is returned, so divan drops it outside the timing.
        .bench_local_values(|mut machine| {
            runtime.block_on(run_turn(&mut machine, k));
            machine
        });
}
