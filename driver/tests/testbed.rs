//! The multi-host test bed (scripts/testbed): hosts that share nothing with this machine or with
//! each other, checked as a user sees them through ssh. Where the bed cannot be built here (not
//! root, no dockerd), each test prints a line starting with `SKIPPED` and passes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::util::testbed::{self, text, Bed};
use crate::util::{
    base_image, docker, interrupt, local_context, runtime, wait_for_record, wait_with_deadline, workspace,
    Harness, DRIVER, FAKE_RANK,
};

/// Where the script keeps the hosts' pid files and engine sockets.
const STATE: &str = "/run/stagehand-testbed";

/// `path` quoted for the remote shell.
fn quote(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', r"'\''"))
}

/// A one-file image archive for `docker import`.
fn probe_tar(content: &str) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(content.len() as u64);
    header.set_mode(0o644);
    builder
        .append_data(&mut header, "probe", content.as_bytes())
        .unwrap();
    builder.into_inner().unwrap()
}

fn engine_id(bed: &Bed, host: &str) -> String {
    bed.ssh_ok(host, "docker info --format '{{.ID}}'")
}

fn has_image(bed: &Bed, host: &str, image: &str) -> bool {
    bed.ssh(host, &format!("docker image inspect {image}"))
        .status
        .success()
}

/// Puts the local base image on `hosts` as a user moves an image without a registry
/// (`docker save | ssh host docker load`); returns its name.
fn load_base_image(bed: &Bed, hosts: &[&str]) -> &'static str {
    base_image();
    let image = "stagehand-base:bookworm";
    let save = std::process::Command::new("docker")
        .args(["save", image])
        .output()
        .unwrap();
    assert!(save.status.success(), "docker save: {}", text(&save.stderr));
    for host in hosts {
        let load = bed.ssh_with_input(host, "docker load", &save.stdout);
        assert!(
            load.status.success(),
            "docker load on {host}: {}",
            text(&load.stderr)
        );
    }
    image
}

#[test]
fn testbed_hosts_share_nothing_with_the_machine_or_each_other() {
    let Some(bed) = testbed::up("testbed_hosts_share_nothing_with_the_machine_or_each_other", 2) else {
        return;
    };
    // Each host its own engine: its own ID, its own hostname.
    let local = docker(&["info", "--format", "{{.ID}}"]).trim().to_string();
    let ids: Vec<String> = bed.hosts.iter().map(|h| engine_id(&bed, h)).collect();
    assert_ne!(ids[0], ids[1]);
    assert!(
        !ids.contains(&local),
        "a host reports the machine's engine {local}"
    );
    for host in &bed.hosts {
        assert_eq!(&bed.ssh_ok(host, "hostname"), host);
    }

    // An image loaded on th1 is on th1 only.
    let image = format!("stagehand-testbed-probe:{}", std::process::id());
    let load = bed.ssh_with_input("th1", &format!("docker import - {image}"), &probe_tar(&image));
    assert!(
        load.status.success(),
        "docker import on th1: {}",
        text(&load.stderr)
    );
    assert!(has_image(&bed, "th1", &image));
    assert!(!has_image(&bed, "th2", &image), "th2 sees th1's image");
    let local = std::process::Command::new("docker")
        .args(["image", "inspect", &image])
        .output()
        .unwrap();
    assert!(!local.status.success(), "the machine's engine sees th1's image");

    // Nothing of the machine's files that a real remote host would lack: the checkout and its
    // target/ (the driver, the runtime), ~/.cache/stagehand (the torch venv), the tests' scratch
    // folders. (A hidden folder may remain as an empty mount point.)
    let scratch = tempfile::tempdir().unwrap();
    std::fs::write(scratch.path().join("stages.json"), "{}").unwrap();
    let mut paths = vec![
        workspace().join("Cargo.toml"),
        PathBuf::from(DRIVER),
        scratch.path().join("stages.json"),
    ];
    if let Some(home) = std::env::var_os("HOME") {
        paths.push(PathBuf::from(home).join(".cache/stagehand"));
    }
    for path in paths.iter().filter(|p| p.exists()) {
        for host in &bed.hosts {
            let out = bed.ssh(host, &format!("test -e {}", quote(path)));
            assert_eq!(
                out.status.code(),
                Some(1),
                "{} is visible on {host}",
                path.display()
            );
        }
    }
    let listing = bed.ssh_ok(
        "th1",
        &format!("if [ -d {0} ]; then ls -A {0}; fi", quote(&workspace())),
    );
    assert!(listing.is_empty(), "the checkout shows on th1: {listing}");
    // The test's own check works: what a host does have is seen.
    bed.ssh_ok("th1", "test -S /var/run/docker.sock && test -x /usr/bin/docker");
}

#[test]
fn testbed_hosts_reach_each_other_and_a_cut_host_is_unreachable_until_healed() {
    let Some(bed) = testbed::up(
        "testbed_hosts_reach_each_other_and_a_cut_host_is_unreachable_until_healed",
        2,
    ) else {
        return;
    };
    let (th1, th2) = (bed.address("th1"), bed.address("th2"));
    assert_ne!(th1, th2);
    assert!(bed.reaches("th1", &th2, 22), "th1 cannot reach th2 at {th2}");
    assert!(bed.reaches("th2", &th1, 22), "th2 cannot reach th1 at {th1}");
    // And the driver machine, where a rank or a rendezvous could listen.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    assert!(
        bed.reaches("th1", &bed.gateway(), port),
        "th1 cannot reach the machine"
    );

    bed.cut("th2");
    assert!(
        !bed.reaches("th1", &th2, 22),
        "th1 still reaches th2 after the cut"
    );
    let ssh = bed.ssh("th2", "true");
    assert!(!ssh.status.success(), "ssh th2 still works after the cut");
    assert!(
        bed.reaches("th1", &bed.gateway(), port),
        "the cut took th1 down too"
    );

    bed.heal("th2");
    assert!(
        bed.reaches("th1", &th2, 22),
        "th1 does not reach th2 after the heal"
    );
    bed.ssh_ok("th2", "docker version");
}

#[test]
fn testbed_a_host_runs_containers_of_the_base_image_and_the_drivers_ranks() {
    let Some(bed) = testbed::up(
        "testbed_a_host_runs_containers_of_the_base_image_and_the_drivers_ranks",
        2,
    ) else {
        return;
    };
    let image = load_base_image(&bed, &["th1"]);
    // A host-network container is in th1's namespace: it has th1's name and reaches th2.
    let th2 = bed.address("th2");
    let out = bed.ssh_ok(
        "th1",
        &format!(
            "docker run --rm --network host {image} bash -c 'hostname; timeout 3 bash -c \"</dev/tcp/{th2}/22\" && echo reached'"
        ),
    );
    assert_eq!(out.lines().collect::<Vec<_>>(), ["th1", "reached"], "{out}");

    // The driver runs a rank there as on any server: it builds the image on th1 and copies in the
    // program th1 lacks, here one with a hole, which Docker 20.10 refuses as a GNU sparse tar
    // entry ("unhandled tar header type 83") unless the driver writes it as a plain file.
    let h = Harness::new("testbed");
    let program = h.dir.path().join("fake-rank");
    std::fs::copy(FAKE_RANK, &program).unwrap();
    // Bytes past an ELF file's sections are never read: a hole at its end leaves it runnable.
    let file = std::fs::OpenOptions::new().write(true).open(&program).unwrap();
    file.set_len(file.metadata().unwrap().len() + (1 << 20)).unwrap();
    drop(file);
    let exp = h.config(&format!(
        "machines: [th1]\ncontainer: {{build: '{}'}}\ncommand: ['{}', --iterations, '2']\n",
        local_context().display(),
        program.display()
    ));
    let run = h.run(&exp, &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    let hosts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("hosts.json")).unwrap()).unwrap();
    assert_eq!(hosts[0]["host"], "th1", "{hosts}");
    assert_eq!(hosts[0]["copied_in"][0], program.display().to_string(), "{hosts}");
    let left = bed.ssh_ok(
        "th1",
        &format!("docker ps -aq --filter label=stagehand.name={}", h.name),
    );
    assert!(left.is_empty(), "containers left on th1: {left}");
}

#[test]
fn testbed_ranks_on_two_hosts_reach_the_first_at_the_address_found_there() {
    let Some(bed) = testbed::up(
        "testbed_ranks_on_two_hosts_reach_the_first_at_the_address_found_there",
        2,
    ) else {
        return;
    };
    // The image named is on th1 alone: the driver sends it to th2, as it sends one it built.
    let image = load_base_image(&bed, &["th1"]);
    // Every rank connects to MASTER_ADDR (th1's sshd stands in for rank 0's rendezvous): an ssh
    // alias such as `th1` resolves nowhere but on this machine, so the address must be the one
    // found on th1.
    let h = Harness::new("testbed-master");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\ncommand: [bash, -c, 'timeout 5 bash -c \"</dev/tcp/$MASTER_ADDR/22\" && echo reached $MASTER_ADDR']\n"
    ));
    let run = h.run(&exp, &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    let th1 = bed.address("th1");
    for rank in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("rank-{rank}.log"))).unwrap();
        assert!(log.contains(&format!("reached {th1}")), "rank {rank}: {log}");
    }
    let hosts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("hosts.json")).unwrap()).unwrap();
    assert_eq!(hosts[1]["host"], "th2", "{hosts}");
    assert_eq!(hosts[1]["image_received_from"], "th1", "{hosts}");
    assert!(has_image(&bed, "th2", image));

    // `master_addr:` overrides what is found: an unused address of the bed fails every rank.
    let unused = format!("{}.250", th1.rsplit_once('.').unwrap().0);
    let h = Harness::new("testbed-master-override");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\nmaster_addr: {unused}\ncommand: [bash, -c, 'echo $MASTER_ADDR; timeout 2 bash -c \"</dev/tcp/$MASTER_ADDR/22\"']\n"
    ));
    let run = h.run(&exp, &[]);
    assert_ne!(run.code(), 0, "{}", run.stderr());
    let (dir, _) = h.summary();
    let log = std::fs::read_to_string(dir.join("rank-1.log")).unwrap();
    assert!(log.contains(&unused), "{log}");
}

#[test]
fn testbed_preflight_refuses_a_runtime_that_cannot_start_on_a_host_and_names_it() {
    let Some(bed) = testbed::up(
        "testbed_preflight_refuses_a_runtime_that_cannot_start_on_a_host_and_names_it",
        1,
    ) else {
        return;
    };
    let image = load_base_image(&bed, &["th1"]);
    // th1 sees neither this machine's torch nor its build: the runtime binary is copied in, but
    // the libtorch it links is not there. Preflight says so before any rank starts.
    let h = Harness::new("testbed-self-check");
    let exp = h.config(&format!(
        "machines: [th1]\ncontainer: {image}\nmodule: mlp\niterations: 1\n"
    ));
    let run = h.run(&exp, &["--runtime", runtime().to_str().unwrap()]);
    assert_eq!(run.code(), 3, "preflight failed: {}", run.stderr());
    let stderr = run.stderr();
    assert!(stderr.contains("the runtime cannot start on th1"), "{stderr}");
    assert!(
        stderr.contains("libtorch_cpu.so"),
        "names what is missing: {stderr}"
    );
    let left = bed.ssh_ok("th1", "docker ps -aq");
    assert!(left.is_empty(), "containers left on th1: {left}");
}

/// What the machine shows of the bed: namespaces, links, firewall rules, the ssh block, processes
/// in the hosts' network namespaces (given their inodes), state and data folders.
fn leftovers(netns_inodes: &[u64]) -> Vec<String> {
    let mut left = Vec::new();
    let netns = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    for line in text(&netns.stdout)
        .lines()
        .filter(|l| l.starts_with("stagehand-"))
    {
        left.push(format!("network namespace {line}"));
    }
    let links = std::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    for line in text(&links.stdout).lines().filter(|l| l.contains("sh-tb")) {
        left.push(format!("link {line}"));
    }
    for chain in ["DOCKER-USER", "FORWARD"] {
        let rules = std::process::Command::new("iptables")
            .args(["-w", "-S", chain])
            .output()
            .unwrap();
        for rule in text(&rules.stdout)
            .lines()
            .filter(|r| r.contains("sh-tb") || r.contains("stagehand"))
        {
            left.push(format!("firewall rule {rule}"));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        let config = std::fs::read_to_string(PathBuf::from(home).join(".ssh/config")).unwrap_or_default();
        if config.contains("stagehand testbed") {
            left.push("the ssh block in ~/.ssh/config".into());
        }
    }
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(link) = std::fs::read_link(entry.path().join("ns/net")) else {
            continue;
        };
        let link = link.to_string_lossy().into_owned();
        if netns_inodes.iter().any(|i| link == format!("net:[{i}]")) {
            let cmdline = std::fs::read_to_string(entry.path().join("cmdline")).unwrap_or_default();
            left.push(format!(
                "process {} ({})",
                entry.file_name().to_string_lossy(),
                cmdline.replace('\0', " ").trim()
            ));
        }
    }
    if Path::new(STATE).exists() {
        left.push(STATE.into());
    }
    let keep = std::env::var("STAGEHAND_TESTBED_KEEP_IMAGES").is_ok_and(|v| v == "1");
    let data =
        std::env::var("STAGEHAND_TESTBED_DATA").unwrap_or_else(|_| "/var/lib/stagehand-testbed".into());
    if !keep && Path::new(&data).exists() {
        left.push(data);
    }
    left
}

#[test]
fn testbed_up_is_idempotent_and_repairs_and_down_leaves_nothing() {
    let Some(mut bed) = testbed::up("testbed_up_is_idempotent_and_repairs_and_down_leaves_nothing", 2) else {
        return;
    };
    let ids: Vec<String> = bed.hosts.iter().map(|h| engine_id(&bed, h)).collect();
    let again = testbed::testbed(&["up", "2"], Duration::from_secs(180));
    assert!(again.status.success(), "{}", text(&again.stderr));
    let said = text(&again.stderr);
    assert!(
        said.contains("th1: already up") && said.contains("th2: already up"),
        "{said}"
    );

    // A host whose engine died is repaired, and keeps its engine ID.
    let pid = std::fs::read_to_string(format!("{STATE}/th2/docker.pid")).unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    let repair = testbed::testbed(&["up", "2"], Duration::from_secs(180));
    assert!(repair.status.success(), "{}", text(&repair.stderr));
    let said = text(&repair.stderr);
    assert!(
        said.contains("th1: already up") && said.contains("th2: daemons restarted"),
        "{said}"
    );
    let after: Vec<String> = bed.hosts.iter().map(|h| engine_id(&bed, h)).collect();
    assert_eq!(after, ids);

    // The hosts' network namespaces, to find any process of theirs after `down`.
    let inodes: Vec<u64> = bed
        .hosts
        .iter()
        .map(|h| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(format!("/run/netns/stagehand-{h}"))
                .unwrap()
                .ino()
        })
        .collect();
    assert!(leftovers(&[]).len() > 2, "the bed is up, yet nothing shows");
    let down = bed.down();
    assert!(down.status.success(), "{}", text(&down.stderr));
    let left = leftovers(&inodes);
    assert!(left.is_empty(), "down left: {left:#?}");
    let alias = std::process::Command::new("ssh")
        .args(["-G", "th1"])
        .output()
        .unwrap();
    assert!(
        text(&alias.stdout).lines().any(|l| l == "hostname th1"),
        "th1 still has an ssh alias after down"
    );
    // Down again: nothing to do, and it says so.
    let again = bed.down();
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(text(&again.stderr).contains("nothing left"));
}

/// An image of just what the lease guard and a sleeping `command:` need (`/bin/sh`, `sleep` and
/// their libraries, copied from this machine), a few MB where the base image is 212: a user's
/// image that holds nothing of stagehand's.
fn shell_only_image_tar() -> Vec<u8> {
    let mut files: Vec<(PathBuf, String)> = vec![
        (PathBuf::from("/bin/dash"), "bin/sh".into()),
        (PathBuf::from("/bin/sleep"), "bin/sleep".into()),
    ];
    let ldd = std::process::Command::new("ldd")
        .args(["/bin/dash", "/bin/sleep"])
        .output()
        .expect("ldd");
    for line in text(&ldd.stdout).lines() {
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or `/lib64/ld-linux-x86-64.so.2 (0x...)`
        if !line.contains("(0x") {
            continue; // `/bin/dash:`, the header of each program's list
        }
        let path = line
            .split("=>")
            .last()
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap_or("");
        if path.starts_with('/') && !files.iter().any(|(p, _)| p.as_path() == Path::new(path)) {
            files.push((PathBuf::from(path), path.trim_start_matches('/').to_string()));
        }
    }
    let mut builder = tar::Builder::new(Vec::new());
    for (path, name) in files {
        // Follows symlinks: the library's own bytes under the name the loader asks for.
        let mut file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        builder.append_file(&name, &mut file).unwrap();
    }
    builder.into_inner().unwrap()
}

/// Imports the shell-only image on every host of the bed; returns its name.
fn import_shell_image(bed: &Bed) -> String {
    let image = format!("stagehand-testbed-shell:{}", std::process::id());
    let tar = shell_only_image_tar();
    for host in &bed.hosts {
        let out = bed.ssh_with_input(host, &format!("docker import - {image}"), &tar);
        assert!(
            out.status.success(),
            "docker import on {host}: {}",
            text(&out.stderr)
        );
    }
    image
}

#[test]
fn testbed_a_host_cut_off_mid_run_is_named_and_its_container_stops_itself() {
    let test = "testbed_a_host_cut_off_mid_run_is_named_and_its_container_stops_itself";
    let Some(bed) = testbed::up(test, 2) else {
        return;
    };
    let image = import_shell_image(&bed);
    let h = Harness::new("testbed-cut");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\ncommand: [sleep, '600']\n"
    ));
    let driver = h.spawn(&exp, &[]);
    let ps = |host: &str, all: &str| {
        bed.ssh_ok(
            host,
            &format!(
                "docker ps {all} --filter label=stagehand.name={} --format '{{{{.Names}}}} {{{{.State}}}} {{{{.Status}}}}'",
                h.name
            ),
        )
    };
    let start = std::time::Instant::now();
    while bed.hosts.iter().any(|host| !ps(host, "").contains("running")) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // th2 cut off: the run ends within 60 s, naming th2.
    bed.cut("th2");
    let cut = std::time::Instant::now();
    let out = wait_with_deadline(driver, Duration::from_secs(90));
    let ended = cut.elapsed();
    let stderr = text(&out.stderr);
    assert!(
        ended < Duration::from_secs(60),
        "the run ended {ended:?} after the cut: {stderr}"
    );
    // Exit 4: containers could not all be removed.
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "failed", "{summary}");
    assert_eq!(summary["failure"]["cause"]["kind"], "host_lost", "{summary}");
    assert_eq!(summary["failure"]["cause"]["host"], "th2", "{summary}");
    // th1's rank was stopped (seen to exit by the stop, or its container removed first), or
    // ended with a code of its own as its peer went; th2's was never seen to exit, and its
    // container is recorded as not removed, with how to remove it.
    let ranks = &summary["ranks"];
    let own_code = ranks[0]["exit_code"] != 137 && ranks[0]["exit_code"] != 143;
    assert!(
        ranks[0]["state"] == "removed"
            || ranks[0]["state"] == "stopped"
            || (ranks[0]["state"] == "exited" && own_code),
        "{ranks}"
    );
    assert_eq!(ranks[1]["state"], "not_removed", "{ranks}");
    assert_eq!(ranks[1]["exited"], false, "{ranks}");
    assert!(ranks[1]["exit_code"].is_null(), "{ranks}");
    let left = summary["containers_not_removed"]
        .as_array()
        .expect("containers_not_removed");
    assert_eq!(left.len(), 1, "{left:?}");
    let id = summary["id"].as_str().unwrap();
    let name = format!("{id}-r1");
    assert_eq!(left[0]["host"], "th2");
    assert_eq!(left[0]["name"], name.as_str());
    assert_eq!(left[0]["ranks"], serde_json::json!([1]));
    let by_hand = format!("ssh th2 docker rm -f {name}");
    assert_eq!(left[0]["remove_by_hand"], by_hand.as_str());
    assert!(
        stderr.contains("driver: lost th2: it stopped answering over SSH"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{name} (id ")) && stderr.contains(&by_hand),
        "{stderr}"
    );
    assert!(
        ps("th1", "-a").is_empty(),
        "containers left on th1: {}",
        ps("th1", "-a")
    );

    // Healed, th2 shows its container stopped by itself: its lease expired on th2's clock.
    bed.heal("th2");
    let healed = std::time::Instant::now();
    let status = loop {
        let status = ps("th2", "-a");
        if !status.contains("running") {
            break status;
        }
        assert!(
            healed.elapsed() < Duration::from_secs(35),
            "th2's container still runs {:?} after the heal ({ended:?} after the cut): {status}",
            healed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        status.starts_with(&format!("{name} exited Exited (86)")),
        "{status}"
    );
    eprintln!(
        "{test}: the run ended {ended:?} after the cut; th2 seen with its container stopped {:?} after the heal",
        healed.elapsed()
    );
    // The command the driver printed removes it.
    let removed = std::process::Command::new("sh")
        .args(["-c", &by_hand])
        .output()
        .unwrap();
    assert!(removed.status.success(), "{by_hand}: {}", text(&removed.stderr));
    assert!(
        ps("th2", "-a").is_empty(),
        "containers left on th2: {}",
        ps("th2", "-a")
    );
}

/// `h`'s run's containers on `host`, a `NAME STATE` line each (`docker ps -a`).
fn run_containers(bed: &Bed, h: &Harness, host: &str) -> String {
    bed.ssh_ok(
        host,
        &format!(
            "docker ps -a --filter label=stagehand.name={} --format '{{{{.Names}}}} {{{{.State}}}}'",
            h.name
        ),
    )
}

/// Waits, 60 s at most, until every host of the bed runs a container of `h`'s run.
fn wait_until_running(bed: &Bed, h: &Harness) {
    let start = std::time::Instant::now();
    while bed
        .hosts
        .iter()
        .any(|host| !run_containers(bed, h, host).contains("running"))
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Data that lives on the hosts alone (nothing at that path on this machine), named with its
/// format (`cifar10:DIR`): every host mounts it, and a host without it is named at preflight.
#[test]
fn testbed_data_on_the_hosts_alone_is_mounted_and_a_host_without_it_is_named() {
    let test = "testbed_data_on_the_hosts_alone_is_mounted_and_a_host_without_it_is_named";
    let Some(bed) = testbed::up(test, 2) else {
        return;
    };
    let image = import_shell_image(&bed);
    // Each host's /tmp is its own, hidden from the others and from this machine.
    let folder = format!("/tmp/stagehand-test-data-{}", std::process::id());
    assert!(!Path::new(&folder).exists(), "{folder} is on this machine");
    for host in &bed.hosts {
        bed.ssh_ok(
            host,
            &format!("mkdir -p {folder} && echo {host} > {folder}/data_batch_1.bin"),
        );
    }
    let h = Harness::new("testbed-data");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\ndata_dir: 'cifar10:{folder}'\n\
         command: [sh, -c, 'read l < {folder}/data_batch_1.bin && echo data from $l']\n"
    ));
    let run = h.run(&exp, &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, _) = h.summary();
    for (rank, host) in ["th1", "th2"].iter().enumerate() {
        let log = std::fs::read_to_string(dir.join(format!("rank-{rank}.log"))).unwrap();
        assert!(log.contains(&format!("data from {host}")), "rank {rank}: {log}");
    }
    // Gone from th2: preflight names it, and nothing starts.
    bed.ssh_ok("th2", &format!("rm -r {folder}"));
    let h = Harness::new("testbed-data-missing");
    let run = h.run(
        &h.config(&format!(
            "machines: [th1, th2]\ncontainer: {image}\ndata_dir: 'cifar10:{folder}'\ncommand: [true]\n"
        )),
        &[],
    );
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr().contains(&format!("{folder} does not exist on th2")),
        "{}",
        run.stderr()
    );
    bed.ssh_ok("th1", &format!("rm -r {folder}"));
    for host in &bed.hosts {
        let _ = bed.ssh(host, &format!("docker rmi {image}"));
    }
}

/// A host whose Docker engine stops mid-run (as `systemctl stop docker` stops it) while ssh still
/// reaches it: the run ends failed, with th2 lost, and the reason names th2's engine, not th2 as
/// gone, since `ssh th2` still works.
#[test]
fn testbed_an_engine_stopped_mid_run_is_named_as_the_engine_not_the_host() {
    let test = "testbed_an_engine_stopped_mid_run_is_named_as_the_engine_not_the_host";
    let Some(bed) = testbed::up(test, 2) else {
        return;
    };
    let image = import_shell_image(&bed);
    let h = Harness::new("testbed-engine");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\ncommand: [sleep, '600']\n"
    ));
    let driver = h.spawn(&exp, &[]);
    let ps = |host: &str| run_containers(&bed, &h, host);
    wait_until_running(&bed, &h);
    bed.stop_engine("th2");
    let stopped = std::time::Instant::now();
    let out = wait_with_deadline(driver, Duration::from_secs(120));
    let ended = stopped.elapsed();
    let stderr = text(&out.stderr);
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "failed", "{summary}\n{stderr}");
    let cause = &summary["failure"]["cause"];
    assert_eq!(cause["kind"], "host_lost", "{summary}\n{stderr}");
    assert_eq!(cause["host"], "th2", "{summary}");
    let engine = "its Docker engine stopped answering, though `ssh th2` still works";
    assert!(
        cause["reason"].as_str().is_some_and(|r| r.starts_with(engine)),
        "{summary}"
    );
    assert!(
        stderr.contains(&format!("driver: lost th2: {engine}")),
        "{stderr}"
    );
    assert!(!stderr.contains("took longer than 0 s"), "{stderr}");
    assert_eq!(ps("th1"), "", "containers left on th1");
    eprintln!("{test}: the run ended {ended:?} after th2's engine stopped");
    // th2's engine back for the tests after this one, without the container it kept.
    let up = testbed::testbed(&["up", "2"], Duration::from_secs(180));
    assert!(up.status.success(), "{}", text(&up.stderr));
    let _ = bed.ssh(
        "th2",
        &format!(
            "docker ps -aq --filter label=stagehand.name={} | xargs -r docker rm -f",
            h.name
        ),
    );
    let _ = bed.ssh("th1", &format!("docker rmi {image}"));
    let _ = bed.ssh("th2", &format!("docker rmi {image}"));
}

/// With `max_restarts`, a host cut off long enough to be lost and back before its containers
/// are given up on: the driver removes every container of the run on both hosts, reaches th2
/// on a new connection, and starts every rank again; the run succeeds and leaves nothing.
#[test]
fn testbed_a_host_lost_and_back_gets_its_ranks_started_again() {
    let test = "testbed_a_host_lost_and_back_gets_its_ranks_started_again";
    let Some(bed) = testbed::up(test, 2) else {
        return;
    };
    let image = import_shell_image(&bed);
    let h = Harness::new("testbed-restart");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\ncommand: [sleep, '40']\nmax_restarts: 1\n"
    ));
    let driver = h.spawn(&exp, &[]);
    let ps = |host: &str| run_containers(&bed, &h, host);
    wait_until_running(&bed, &h);
    let record = wait_for_record(&h.records(), Duration::from_secs(10));
    bed.cut("th2");
    // Healed once the driver has given th2 up for lost, well within the 20 s it keeps trying to
    // remove th2's container.
    let cut = std::time::Instant::now();
    loop {
        let summary = std::fs::read_to_string(record.join("summary.json")).unwrap_or_default();
        if summary.contains(r#""kind": "host_lost""#) {
            break;
        }
        assert!(
            cut.elapsed() < Duration::from_secs(60),
            "th2 was not given up for lost: {summary}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    bed.heal("th2");
    let out = wait_with_deadline(driver, Duration::from_secs(180));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    let restarts = summary["restarts"].as_array().expect("the restart is recorded");
    assert_eq!(restarts.len(), 1, "{summary}");
    assert_eq!(restarts[0]["failure"]["cause"]["kind"], "host_lost", "{summary}");
    assert_eq!(restarts[0]["failure"]["cause"]["host"], "th2", "{summary}");
    assert!(summary["containers_not_removed"].is_null(), "{summary}");
    assert!(
        stderr.contains("driver: starting every rank again, as they first started"),
        "{stderr}"
    );
    for host in &bed.hosts {
        assert_eq!(ps(host), "", "containers left on {host}");
    }
}

#[test]
fn testbed_a_failing_rank_and_ctrl_c_leave_nothing_on_any_host() {
    let test = "testbed_a_failing_rank_and_ctrl_c_leave_nothing_on_any_host";
    let Some(bed) = testbed::up(test, 2) else {
        return;
    };
    let image = import_shell_image(&bed);
    let left = |h: &Harness| -> Vec<String> {
        bed.hosts
            .iter()
            .map(|host| {
                let ids = bed.ssh_ok(
                    host,
                    &format!("docker ps -aq --filter label=stagehand.name={}", h.name),
                );
                format!("{host}: {}", ids.trim())
            })
            .filter(|line| !line.ends_with(": "))
            .collect()
    };

    // Rank 1 on th2 fails; rank 0 on th1 would sleep for ten minutes. The run ends failed, with
    // th2's exit code, and neither host keeps a container.
    let h = Harness::new("testbed-failing-rank");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\n\
         command: [sh, -c, 'if [ \"$RANK\" = 1 ]; then sleep 1; exit 3; fi; sleep 600']\n"
    ));
    let run = h.run(&exp, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert!(run.elapsed < Duration::from_secs(60), "took {:?}", run.elapsed);
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "failed", "{summary}");
    assert_eq!(summary["ranks"][1]["exit_code"], 3, "{summary}");
    assert!(left(&h).is_empty(), "containers left: {:?}", left(&h));

    // Ctrl-C while both ranks run: the run ends interrupted and both hosts are clean.
    let h = Harness::new("testbed-ctrl-c");
    let exp = h.config(&format!(
        "machines: [th1, th2]\ncontainer: {image}\ncommand: [sleep, '600']\n"
    ));
    let driver = h.spawn(&exp, &[]);
    let start = std::time::Instant::now();
    while bed.hosts.iter().any(|host| {
        bed.ssh_ok(
            host,
            &format!("docker ps -q --filter label=stagehand.name={}", h.name),
        )
        .trim()
        .is_empty()
    }) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let since = std::time::Instant::now();
    interrupt(&driver);
    let (_, summary) = h.expect_stop(driver, since, Duration::from_secs(30), 130);
    assert_eq!(summary["status"], "interrupted", "{summary}");
    assert!(left(&h).is_empty(), "containers left: {:?}", left(&h));
    for host in &bed.hosts {
        let _ = bed.ssh(host, &format!("docker rmi {image}"));
    }
}

/// Every container of `h`'s run on `host`, as its rank label, the device requests the engine holds
/// for it (`docker inspect`) and `NVIDIA_VISIBLE_DEVICES` as its first process got it from the
/// engine's GPU driver (its environment in /proc), sorted by rank label.
fn device_requests(bed: &Bed, host: &str, h: &Harness) -> Vec<(String, serde_json::Value, String)> {
    let ids = bed.ssh_ok(
        host,
        &format!("docker ps -q --filter label=stagehand.name={}", h.name),
    );
    let mut out = Vec::new();
    for id in ids.split_whitespace() {
        let line = bed.ssh_ok(
            host,
            &format!(
                "docker inspect -f '{{{{index .Config.Labels \"stagehand.rank\"}}}} {{{{json .HostConfig.DeviceRequests}}}}' {id}; \
                 tr '\\0' '\\n' </proc/$(docker inspect -f '{{{{.State.Pid}}}}' {id})/environ"
            ),
        );
        let (ranks, rest) = line.split_once(' ').unwrap();
        let (requests, env) = rest.split_once('\n').unwrap_or((rest, ""));
        let visible = env
            .lines()
            .find_map(|l| l.strip_prefix("NVIDIA_VISIBLE_DEVICES="))
            .unwrap_or("")
            .to_string();
        out.push((
            ranks.to_string(),
            serde_json::from_str(requests.trim()).unwrap(),
            visible,
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Waits until `n` containers of `h`'s run are running on `host`.
fn wait_for_containers(bed: &Bed, host: &str, h: &Harness, n: usize) {
    let start = std::time::Instant::now();
    loop {
        let ids = bed.ssh_ok(
            host,
            &format!("docker ps -q --filter label=stagehand.name={}", h.name),
        );
        if ids.split_whitespace().count() == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{n} container(s) did not start on {host}: {ids:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn testbed_each_container_asks_its_engine_for_its_hosts_gpus() {
    let test = "testbed_each_container_asks_its_engine_for_its_hosts_gpus";
    let Some(bed) = testbed::up(test, 2) else {
        return;
    };
    let image = import_shell_image(&bed);
    // The bed's engines carry a stand-in for the NVIDIA container toolkit (scripts/testbed): they
    // accept GPU device requests and start the containers; no GPU is there, so the ranks sleep.
    let body = format!("machines: [th1:0, th1:1, th2:1]\ncontainer: {image}\ncommand: [sleep, '600']\n");
    let request = |ids: &[&str]| {
        serde_json::json!([{
            "Driver": "nvidia", "Count": 0, "DeviceIDs": ids, "Capabilities": [["gpu"]], "Options": null
        }])
    };

    // One container per rank: each asks for every GPU the experiment has on its host (NCCL
    // reaches the GPUs of the host's other ranks directly), by the host's numbering.
    let h = Harness::new("testbed-gpus-per-rank");
    let driver = h.spawn(&h.config(&body), &[]);
    wait_for_containers(&bed, "th1", &h, 2);
    wait_for_containers(&bed, "th2", &h, 1);
    let th1 = device_requests(&bed, "th1", &h);
    let th2 = device_requests(&bed, "th2", &h);
    assert_eq!(th1.len(), 2, "{th1:?}");
    assert_eq!(
        (th1[0].0.as_str(), &th1[0].1),
        ("0", &request(&["0", "1"])),
        "{th1:?}"
    );
    assert_eq!(
        (th1[1].0.as_str(), &th1[1].1),
        ("1", &request(&["0", "1"])),
        "{th1:?}"
    );
    assert_eq!((th2[0].0.as_str(), &th2[0].1), ("2", &request(&["1"])), "{th2:?}");
    // What the engine made of it: the variable the toolkit's hook reads names the same devices.
    assert_eq!(
        [th1[0].2.as_str(), th1[1].2.as_str(), th2[0].2.as_str()],
        ["0,1", "0,1", "1"]
    );
    let since = std::time::Instant::now();
    interrupt(&driver);
    h.expect_stop(driver, since, Duration::from_secs(30), 130);

    // One container per host: it asks for every GPU of the host's ranks.
    let h = Harness::new("testbed-gpus-per-host");
    let driver = h.spawn(&h.config(&body), &["--launch-single-container"]);
    wait_for_containers(&bed, "th1", &h, 1);
    wait_for_containers(&bed, "th2", &h, 1);
    let th1 = device_requests(&bed, "th1", &h);
    let th2 = device_requests(&bed, "th2", &h);
    assert_eq!(
        (th1[0].0.as_str(), &th1[0].1),
        ("0,1", &request(&["0", "1"])),
        "{th1:?}"
    );
    assert_eq!((th2[0].0.as_str(), &th2[0].1), ("2", &request(&["1"])), "{th2:?}");
    let since = std::time::Instant::now();
    interrupt(&driver);
    h.expect_stop(driver, since, Duration::from_secs(30), 130);
    for host in &bed.hosts {
        let left = bed.ssh_ok(host, "docker ps -aq --filter label=stagehand.name=testbed-gpus");
        assert!(left.trim().is_empty(), "{host}: {left}");
    }
}
