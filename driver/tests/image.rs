//! Images without a registry: build contexts as git and `.dockerignore` define them, the runtime
//! image built from the workspace's source, and (on the test bed) that image built once and sent
//! to every host that lacks it.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::util::experiments::{
    a_rank_killed_after_tracing_leaves_every_trace, assert_every_trace_kept,
    assert_ranks_traced_steps_1_and_2, traced_until_killed,
};
use crate::util::testbed::{self, text, Bed};
use crate::util::{base_image, docker, Harness};

/// How long a run may take that builds the runtime image (a release build of the runtime and
/// libtorch's bindings on two busy cores).
const BUILD_DEADLINE: Duration = Duration::from_secs(1500);

/// The images docker/runtime/Dockerfile starts from, made by scripts/base-image.sh.
const BASES: [&str; 3] = [
    "stagehand-base:bookworm",
    "stagehand-build:bookworm",
    "stagehand-torch:2.11.0-cpu",
];

fn git(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@t"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {}", text(&out.stderr));
}

/// `hosts.json` of the only record.
fn hosts(h: &Harness) -> Vec<Value> {
    let (dir, _) = h.summary();
    let text = std::fs::read_to_string(dir.join("hosts.json")).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn host<'a>(hosts: &'a [Value], name: &str) -> &'a Value {
    hosts
        .iter()
        .find(|h| h["host"] == name)
        .unwrap_or_else(|| panic!("no {name} in {hosts:?}"))
}

#[test]
fn a_build_context_is_what_git_tracks_less_dockerignore_and_its_arguments_reach_the_build() {
    base_image();
    let h = Harness::new("img-context");
    let ctx = h.dir.path().join("ctx");
    let write = |rel: &str, body: &str| {
        let p = ctx.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    };
    write(
        "docker/Dockerfile",
        "FROM stagehand-base:bookworm\nARG GREETING\nCOPY . /ctx\n\
         RUN test ! -e /ctx/notes.tmp && test ! -e /ctx/build/out && test -e /ctx/new.txt \
         && echo \"$GREETING\" > /ctx/greeting\n",
    );
    write(".gitignore", "build/\n");
    write(".dockerignore", "*.tmp\n");
    write("kept.txt", "kept\n");
    write("notes.tmp", "left out by .dockerignore\n");
    write("build/out", "left out by .gitignore\n");
    git(&ctx, &["init", "-q"]);
    git(
        &ctx,
        &[
            "add",
            ".gitignore",
            ".dockerignore",
            "docker",
            "kept.txt",
            "notes.tmp",
        ],
    );
    git(&ctx, &["commit", "-qm", "ctx"]);
    write("new.txt", "not committed, not ignored: sent\n");
    let experiment = |greeting: &str| {
        format!(
            "machines: [localhost]\ncontainer: {{build: '{}', dockerfile: docker/Dockerfile, \
             args: {{GREETING: {greeting}}}}}\ncommand: [cat, /ctx/greeting, /ctx/kept.txt]\n",
            ctx.display()
        )
    };
    let run = h.run(&h.config(&experiment("hello")), &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    // Without a terminal or -v, each step is said as it starts.
    for step in [
        "] Step 1/4 : FROM stagehand-base:bookworm",
        "] Step 4/4 : RUN test ! -e",
    ] {
        assert!(
            run.stderr()
                .lines()
                .any(|l| l.starts_with("[localhost build 0:") && l.contains(step)),
            "{step}: {}",
            run.stderr()
        );
    }
    let (dir, _) = h.summary();
    let log = std::fs::read_to_string(dir.join("rank-0.log")).unwrap();
    assert!(log.contains("hello") && log.contains("kept"), "{log}");
    let first = hosts(&h)[0].clone();
    assert!(
        first["image"].as_str().unwrap().starts_with("stagehand-ctx:"),
        "{first}"
    );

    // A file .dockerignore leaves out does not change the tag: no rebuild.
    write("notes.tmp", "changed, still left out\n");
    let h2 = Harness::new("img-context-again");
    let run = h2.run(&h2.config(&experiment("hello")), &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let again = hosts(&h2)[0].clone();
    assert_eq!(again["image"], first["image"]);
    assert_eq!(again["image_built"], false, "{again}");

    // A sent file changes it, and so does a build argument.
    write("kept.txt", "kept, edited\n");
    let h3 = Harness::new("img-context-edited");
    let run = h3.run(&h3.config(&experiment("bonjour")), &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let edited = hosts(&h3)[0].clone();
    assert_ne!(edited["image"], first["image"]);
    assert_eq!(edited["image_built"], true, "{edited}");
    let (dir, _) = h3.summary();
    let log = std::fs::read_to_string(dir.join("rank-0.log")).unwrap();
    assert!(log.contains("bonjour") && log.contains("kept, edited"), "{log}");
    for tag in [&first["image"], &edited["image"]] {
        let _ = Command::new("docker")
            .args(["rmi", tag.as_str().unwrap()])
            .output();
    }
    h3.assert_no_containers();
}

/// Runs `exp` in image mode: no `--runtime`, so the ranks run the runtime image built from the
/// workspace's source.
fn run_image(h: &Harness, exp: &std::path::Path) -> crate::util::Run {
    h.run_image_mode(exp, &[], BUILD_DEADLINE)
}

/// The quickstart's settings, shortened.
fn mlp(machines: &str, extra: &str) -> String {
    format!(
        "machines: [{machines}]\nmodule: mlp\nbatch_size: 24\niterations: 3\nlearning_rate: 0.01\n\
         optimizer: sgd\nseed: 0\ndevice: cpu\nthreads: 1\ndata_dir: synthetic\n\
         env: {{OMP_NUM_THREADS: '1'}}\n{extra}"
    )
}

/// The quickstart's MLP as a traced pipeline of three single-rank stages on th1, th2 and th3,
/// under 1F1B.
fn traced_three_host_pipeline(h: &Harness) -> std::path::PathBuf {
    std::fs::write(
        h.dir.path().join("mlp_3stage.json"),
        r#"{"module_to_stage_map": [0,0,1,1,2,2], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2]}}"#,
    )
    .unwrap();
    h.config(&mlp(
        "th1, th2, th3",
        "config_file: mlp_3stage.json\nschedule: 1f1b\nmicrobatches: 2\ndistributed_backend: gloo\n\
         profiler_trace: true\n",
    ))
}

/// Holds the test bed's lock: a build of the runtime image takes both cores, so this test's build
/// and the bed's (which holds the lock too) run one after the other, not against each other.
/// Without the lock file (no /run/lock), the builds may overlap; nothing else changes.
fn one_build_at_a_time() -> Option<nix::fcntl::Flock<std::fs::File>> {
    let file = std::fs::File::create(testbed::LOCK).ok()?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).ok()
}

#[test]
fn the_quickstart_runs_the_runtime_image_built_from_the_workspace() {
    base_image();
    let _build = one_build_at_a_time();
    let h = Harness::new("img-quickstart");
    let exp = h.config(&mlp("localhost, localhost", ""));
    let run = run_image(&h, &exp);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    let facts = hosts(&h)[0].clone();
    let tag = facts["image"].as_str().unwrap().to_string();
    assert!(tag.starts_with("stagehand-runtime-cpu:"), "{facts}");
    // The ranks ran the image's runtime; nothing of this machine's build was mounted.
    let resolved: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.resolved.json")).unwrap()).unwrap();
    assert_eq!(resolved["plan"]["ranks"][0]["argv"][0], "/usr/local/bin/runtime");
    let mounts = resolved["plan"]["mounts"].to_string();
    assert!(
        !mounts.contains("target/release") && !mounts.contains("torch-2.11.0"),
        "{mounts}"
    );
    // The image's torch is its own: the CPU variant, without libtorch_cuda.
    let listing = docker(&[
        "run",
        "--rm",
        "--entrypoint",
        "ls",
        &tag,
        "/opt/site-packages/torch/lib",
    ]);
    assert!(
        listing.contains("libtorch_cpu.so") && !listing.contains("libtorch_cuda.so"),
        "{listing}"
    );
    // And its base has what NCCL's InfiniBand transport opens at run time, as its runtime says.
    let info: Value =
        serde_json::from_str(&docker(&["run", "--rm", &tag, "/usr/local/bin/runtime", "info"])).unwrap();
    assert_eq!(info["rdma"]["ibverbs"], true, "{info}");
    assert_eq!(info["rdma"]["device_files"], false, "no devices given: {info}");

    // The next run reuses it.
    let h2 = Harness::new("img-quickstart-again");
    let exp2 = h2.config(&mlp("localhost", ""));
    let run = run_image(&h2, &exp2);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let again = hosts(&h2)[0].clone();
    assert_eq!(again["image"], facts["image"]);
    assert_eq!(again["image_built"], false);
    h2.assert_no_containers();
}

/// Every one of the `ranks` of `h`'s run traced the two iterations after its warm-up on a host of
/// the bed, and the record holds its trace, copied out of the container there.
fn assert_traces_copied_out(h: &Harness, run: &crate::util::Run, ranks: usize) {
    let (dir, summary) = h.summary();
    assert_every_trace_kept(&summary, &run.stderr(), ranks);
    assert_ranks_traced_steps_1_and_2(&dir, ranks);
}

fn has_image(bed: &Bed, host: &str, image: &str) -> bool {
    bed.ssh(host, &format!("docker image inspect {image}"))
        .status
        .success()
}

fn no_containers(bed: &Bed) {
    for host in &bed.hosts {
        let left = bed.ssh_ok(host, "docker ps -aq");
        assert!(left.trim().is_empty(), "containers left on {host}: {left}");
    }
}

#[test]
fn testbed_the_runtime_image_is_built_once_and_sent_to_every_host_that_lacks_it() {
    let Some(bed) = testbed::up(
        "testbed_the_runtime_image_is_built_once_and_sent_to_every_host_that_lacks_it",
        3,
    ) else {
        return;
    };
    // Only this machine has the images the build starts from; the hosts have nothing at all.
    base_image();
    for host in ["th1", "th2", "th3"] {
        let _ = bed.ssh(host, &format!("docker rmi {}", BASES.join(" ")));
    }
    // (Another test's image, in use, may keep the base system on a host.)
    let lacking: Vec<&str> = BASES.into_iter().filter(|b| !has_image(&bed, "th1", b)).collect();
    assert!(
        lacking.contains(&BASES[1]) && lacking.contains(&BASES[2]),
        "{lacking:?}"
    );

    // The quickstart across two hosts: built on th1, streamed to th2.
    let h = Harness::new("tb-img-quickstart");
    let exp = h.config(&mlp("th1, th2", ""));
    let run = run_image(&h, &exp);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    let facts = hosts(&h);
    let tag = host(&facts, "th1")["image"].as_str().unwrap().to_string();
    assert_eq!(host(&facts, "th1")["image_built"], true, "{facts:?}");
    // The building host got the bases from this machine's engine, sent by the driver.
    for base in lacking {
        assert!(has_image(&bed, "th1", base), "{base}");
        assert!(
            run.stderr()
                .lines()
                .any(|l| l.starts_with(&format!("driver: sending {base} ("))
                    && l.ends_with("from this machine to th1")),
            "{base}: {}",
            run.stderr()
        );
    }
    assert_eq!(host(&facts, "th2")["image_built"], false, "{facts:?}");
    assert_eq!(host(&facts, "th2")["image_received_from"], "th1", "{facts:?}");
    assert_eq!(host(&facts, "th2")["image"], tag.as_str());
    assert!(has_image(&bed, "th2", &tag));
    assert!(!has_image(&bed, "th3", &tag));
    // Built once: th2 never saw the bases, so it cannot have built anything.
    assert!(!has_image(&bed, "th2", BASES[1]));
    no_containers(&bed);

    // A pipeline whose stages sit on three hosts: th3 receives the image, nobody rebuilds. Each
    // rank traces inside its container, and the driver copies every trace out over its host's
    // engine API into the record.
    let h = Harness::new("tb-img-pipeline");
    let exp = traced_three_host_pipeline(&h);
    let run = run_image(&h, &exp);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    assert_eq!(summary["stages"].as_array().unwrap().len(), 3, "{summary}");
    assert_traces_copied_out(&h, &run, 3);
    let facts = hosts(&h);
    for name in ["th1", "th2", "th3"] {
        assert_eq!(host(&facts, name)["image"], tag.as_str(), "{facts:?}");
        assert_eq!(host(&facts, name)["image_built"], false, "{facts:?}");
    }
    assert!(
        host(&facts, "th3")["image_received_from"].is_string(),
        "{facts:?}"
    );
    assert!(host(&facts, "th1")["image_received_from"].is_null(), "{facts:?}");
    no_containers(&bed);

    // A hybrid: stage 0 replicated on th1 and th2, stage 1 on th3, its ranks exec'd into one
    // container a host, whose traces are copied out the same way.
    let h = Harness::new("tb-img-hybrid");
    std::fs::write(
        h.dir.path().join("mlp_hybrid.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#,
    )
    .unwrap();
    let exp = h.config(&mlp(
        "th1, th2, th3",
        "config_file: mlp_hybrid.json\nschedule: gpipe\nmicrobatches: 2\ndistributed_backend: gloo\n\
         profiler_trace: true\n",
    ));
    let run = h.run_image_mode(&exp, &["--launch-single-container"], BUILD_DEADLINE);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    assert_traces_copied_out(&h, &run, 3);
    no_containers(&bed);

    // The pipeline again, its rank on th2 killed (its container, over th2's engine) once every
    // rank wrote its trace: the run fails, and the driver, having stopped the other
    // hosts' containers, copies each trace out of its stopped container before removing it.
    let h = Harness::new("tb-img-failed");
    let exp = traced_until_killed(&traced_three_host_pipeline(&h));
    let driver = h.spawn_image_mode(&exp, &[]);
    a_rank_killed_after_tracing_leaves_every_trace(&h, driver, 3, |rank| {
        assert_eq!(rank["host"], "th2", "{rank}");
        let container = rank["handle"].as_str().expect("rank 1 started");
        bed.ssh_ok("th2", &format!("docker kill {container}"));
    });
    no_containers(&bed);

    // A host that cannot reach the master port is named at preflight; nothing starts.
    let port = "29517";
    let th1 = bed.address("th1");
    let rule = ["OUTPUT", "-d", &th1, "-p", "tcp", "--dport", port, "-j", "REJECT"];
    let iptables = |op: &str| {
        let out = Command::new("ip")
            .args(["netns", "exec", "stagehand-th3", "iptables", "-w", op])
            .args(rule)
            .output()
            .unwrap();
        assert!(out.status.success(), "iptables {op}: {}", text(&out.stderr));
    };
    iptables("-A");
    let h = Harness::new("tb-img-unreachable");
    let exp = h.config(&mlp("th1, th2, th3", ""));
    let run = h.run_image_mode(&exp, &["--master-port", port], BUILD_DEADLINE);
    iptables("-D");
    assert_eq!(run.code(), 3, "{}", run.stderr());
    let stderr = run.stderr();
    assert!(
        stderr.contains(&format!("th3 cannot reach the master port at {th1}:{port}")),
        "{stderr}"
    );
    no_containers(&bed);

    // A master address no host resolves (`.invalid` never does) is blamed on the name, not on
    // a port.
    let h = Harness::new("tb-img-unresolved");
    let exp = h.config(&mlp("th1, th2, th3", "master_addr: stagehand-master.invalid\n"));
    let run = h.run_image_mode(&exp, &[], BUILD_DEADLINE);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    let stderr = run.stderr();
    assert!(
        stderr.contains("th1, th2, th3 cannot resolve the master address stagehand-master.invalid (exit 3: "),
        "{stderr}"
    );
    assert!(!stderr.contains("open that port"), "{stderr}");
    no_containers(&bed);
}
