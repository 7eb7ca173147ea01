//! The real runtime as a 2-stage CPU pipeline (gloo over loopback), end to end, with the process
//! backend. (The same pipeline in both container modes is in `docker_runtime`.)

use crate::util::experiments::*;
use crate::util::*;

#[test]
fn a_two_stage_pipeline_runs_as_processes() {
    let runtime = runtime();
    let h = Harness::new("pipe-proc");
    let run = h.run(
        &two_stage_mlp(&h, "process"),
        &["--runtime", runtime.to_str().unwrap()],
    );
    check_pipeline_run(&h, &run);
    h.assert_no_processes();
}
