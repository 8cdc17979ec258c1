//! The checker must fail histories that break the rules, or its silence on
//! the real runs means nothing.

use serde_json::{Map, Value, json};

use super::checker::{History, LoggedWrite, Status, check_exclusion, check_register};
use super::history::{CONTROL, Event};

const MS: u64 = 1_000_000;

fn ev(t_ms: u64, p: i64, e: &str, fields: Value) -> Event {
    let Value::Object(fields) = fields else {
        panic!("object")
    };
    Event {
        t: t_ms * MS,
        p,
        e: e.into(),
        fields,
    }
}

/// A session acquisition of `key` by `(p, w=0, s)`: invoke at `t`, granted
/// and entered 1 ms later, exited at `exit`, then `end` (released or lost).
fn section(p: i64, s: i64, key: i64, t: u64, exit: u64, end: &str, bp: i64) -> Vec<Event> {
    let op = |extra: Value| {
        let mut m: Map<String, Value> = json!({"w": 0, "s": s}).as_object().cloned().unwrap();
        m.extend(extra.as_object().cloned().unwrap());
        Value::Object(m)
    };
    vec![
        ev(t, p, "invoke", op(json!({"k": key, "m": "try"}))),
        ev(t + 1, p, "acquired", op(json!({"bp": bp}))),
        ev(t + 1, p, "entered", op(json!({}))),
        ev(exit, p, "exited", op(json!({}))),
        ev(
            exit + 1,
            p,
            end,
            op(json!({"r": "connection failed: terminated"})),
        ),
    ]
}

fn history(parts: Vec<Vec<Event>>) -> History {
    let mut events: Vec<Event> = parts.into_iter().flatten().collect();
    events.sort_by_key(|e| e.t);
    History::build(events)
}

#[test]
fn checker_passes_sequential_holders() {
    let h = history(vec![
        section(0, 1, 7, 0, 10, "released", 100),
        section(1, 1, 7, 11, 20, "released", 101),
        // Another key may be held at the same time.
        section(2, 1, 8, 5, 15, "released", 102),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!(verdict.held, 3);
    assert_eq!(verdict.clean, 3);
    assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
}

#[test]
fn checker_flags_two_clean_holders_of_one_key() {
    let h = history(vec![
        section(0, 1, 7, 0, 10, "released", 100),
        section(1, 1, 7, 5, 20, "released", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!(verdict.violations.len(), 1);
    assert_eq!(verdict.violations[0].key, 7);
}

#[test]
fn checker_treats_a_section_without_outcome_as_still_holding() {
    let mut open = section(0, 1, 7, 0, 10, "released", 100);
    open.truncate(3); // entered, never exited: the process died
    let h = history(vec![open, section(1, 1, 7, 500, 510, "released", 101)]);
    let verdict = check_exclusion(&h);
    assert_eq!(verdict.unknown, 1);
    assert_eq!(verdict.violations.len(), 1, "possibly holding forever");
}

#[test]
fn checker_excuses_a_successor_granted_after_the_lost_holders_fault() {
    let h = history(vec![
        section(0, 1, 7, 0, 100, "lost", 100),
        vec![ev(
            50,
            CONTROL,
            "fault",
            json!({"kind": "terminate", "bp": 100}),
        )],
        section(1, 1, 7, 60, 70, "released", 101),
    ]);
    assert_eq!(
        h.acqs.iter().filter(|a| a.status() == Status::Lost).count(),
        1
    );
    let verdict = check_exclusion(&h);
    assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
    assert_eq!(verdict.excused.len(), 1);
}

#[test]
fn checker_flags_a_successor_granted_before_the_fault() {
    let h = history(vec![
        section(0, 1, 7, 0, 100, "lost", 100),
        section(1, 1, 7, 20, 30, "released", 101),
        vec![ev(
            50,
            CONTROL,
            "fault",
            json!({"kind": "terminate", "bp": 100}),
        )],
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!(
        verdict.violations.len(),
        1,
        "granted while the lock was intact"
    );
}

#[test]
fn checker_excuses_a_lost_holder_that_learnt_of_its_grant_late() {
    // Granted first, terminated, and told of the grant only after its
    // successor (granted after the termination) had entered; it never
    // learnt its backend pid, so the fault is matched by the key it held.
    let mut late = section(0, 1, 7, 0, 40, "lost", 0);
    late.retain(|e| e.e != "acquired");
    late.iter_mut()
        .filter(|e| e.e == "entered")
        .for_each(|e| e.t = 30 * MS);
    let h = history(vec![
        late,
        vec![ev(
            5,
            CONTROL,
            "fault",
            json!({"kind": "terminate", "bp": 100, "k": 7}),
        )],
        section(1, 1, 7, 8, 50, "released", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
    assert_eq!(verdict.excused.len(), 1);
}

#[test]
fn checker_flags_a_lost_holder_granted_while_a_clean_one_held() {
    // The lost holder was invoked after the clean one was granted: it was
    // granted while the clean one held the lock, whatever happened later.
    let h = history(vec![
        section(0, 1, 7, 0, 50, "released", 100),
        vec![ev(
            20,
            CONTROL,
            "fault",
            json!({"kind": "terminate", "bp": 101}),
        )],
        section(1, 1, 7, 10, 30, "lost", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!(verdict.violations.len(), 1);
}

#[test]
fn checker_ignores_faults_aimed_at_other_backends() {
    let h = history(vec![
        section(0, 1, 7, 0, 100, "lost", 100),
        vec![ev(
            10,
            CONTROL,
            "fault",
            json!({"kind": "terminate", "bp": 999}),
        )],
        section(1, 1, 7, 20, 30, "released", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert!(verdict.violations.is_empty());
    assert_eq!(
        verdict.unattributed.len(),
        1,
        "a loss with no recorded cause"
    );
}

fn write(key: i64, value: i64, token: Option<i64>, s: i64) -> LoggedWrite {
    LoggedWrite {
        key,
        value,
        token,
        op: (0, 0, s),
    }
}

#[test]
fn register_check_passes_a_clean_sequence() {
    let log = [
        write(0, 1, Some(1), 1),
        write(0, 2, Some(2), 2),
        write(0, 3, Some(3), 3),
    ];
    let verdict = check_register(&log, &[(0, 3), (1, 0)], &History::default());
    assert!(verdict.is_sound(), "{verdict:?}");
}

#[test]
fn register_check_flags_one_token_on_two_operations_writes() {
    // Not a decrease, yet two acquisitions wrote with one token: a token
    // issued twice, or a holder that shared its token.
    let log = [
        write(0, 1, Some(1), 1),
        write(0, 2, Some(2), 2),
        write(0, 3, Some(2), 3),
    ];
    let verdict = check_register(&log, &[(0, 3)], &History::default());
    assert_eq!(verdict.token_reused, 1);
    assert_eq!(verdict.stale_accepted, 0);
    assert!(!verdict.is_sound());
}

/// `section` with fencing token `tok` on its `acquired` event.
fn with_token(mut events: Vec<Event>, tok: i64) -> Vec<Event> {
    for e in events.iter_mut().filter(|e| e.e == "acquired") {
        e.fields.insert("tok".into(), tok.into());
    }
    events
}

#[test]
fn checker_flags_one_token_issued_to_two_acquisitions() {
    let h = history(vec![
        with_token(section(0, 1, 7, 0, 10, "released", 100), 5),
        with_token(section(1, 1, 7, 20, 30, "released", 101), 5),
    ]);
    let verdict = check_exclusion(&h);
    assert!(verdict.violations.is_empty());
    assert_eq!(verdict.duplicate_tokens, 1);
}

#[test]
fn checker_flags_a_token_lower_than_a_cleanly_released_predecessors() {
    let h = history(vec![
        with_token(section(0, 1, 7, 0, 10, "released", 100), 6),
        with_token(section(1, 1, 7, 20, 30, "released", 101), 5),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!(verdict.token_inversions, 1);
    assert_eq!(verdict.duplicate_tokens, 0);
    // Growing tokens pass.
    let h = history(vec![
        with_token(section(0, 1, 7, 0, 10, "released", 100), 5),
        with_token(section(1, 1, 7, 20, 30, "released", 101), 6),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!((verdict.token_inversions, verdict.duplicate_tokens), (0, 0));
}

#[test]
fn register_check_flags_a_fence_refusal_of_a_clean_holder() {
    // The fence refused a holder that released cleanly: a newer token was
    // issued while it held the lock.
    let mut events = section(0, 1, 7, 0, 10, "released", 100);
    events.push(ev(5, 0, "write_rejected", json!({"w": 0, "s": 1})));
    let h = history(vec![events]);
    let verdict = check_register(&[], &[(7, 0)], &h);
    assert_eq!(verdict.refused_clean, 1);
    assert!(!verdict.is_sound());
    // A lost holder's refusal is the fence doing its job.
    let mut events = section(0, 1, 7, 0, 10, "lost", 100);
    events.push(ev(5, 0, "write_rejected", json!({"w": 0, "s": 1})));
    let verdict = check_register(&[], &[(7, 0)], &history(vec![events]));
    assert_eq!(verdict.refused_clean, 0);
}

#[test]
fn checker_matches_a_fault_by_key_only_if_no_known_holder_was_on_its_backend() {
    // Holder 0 never learnt its pid; the termination was aimed at backend
    // 101, on which operation (1, 0, 1) was running (it knew its pid): the
    // fault was not holder 0's: its overlap with holder 2 is not excused
    // (its loss has no recorded cause left).
    let mut blind = section(0, 1, 7, 0, 100, "lost", 0);
    blind.retain(|e| e.e != "acquired");
    let h = history(vec![
        blind,
        section(1, 1, 9, 1, 60, "lost", 101),
        vec![ev(
            50,
            CONTROL,
            "fault",
            json!({"kind": "terminate", "bp": 101, "k": 7}),
        )],
        section(2, 1, 7, 55, 70, "released", 102),
    ]);
    let verdict = check_exclusion(&h);
    assert!(verdict.excused.is_empty(), "{verdict:?}");
    assert_eq!(verdict.unattributed.len(), 1, "{verdict:?}");
}

#[test]
fn checker_ends_a_killed_processes_section_at_the_kill() {
    let mut open = section(0, 1, 7, 0, 10, "released", 100);
    open.truncate(3); // entered, then kill -9
    let kill = vec![ev(
        50,
        CONTROL,
        "fault",
        json!({"kind": "kill", "target": 0}),
    )];
    // A successor after the kill is fine ...
    let h = history(vec![
        open.clone(),
        kill.clone(),
        section(1, 1, 7, 60, 70, "released", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!((verdict.killed, verdict.unknown), (1, 0));
    assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
    // ... one that entered before it is a violation.
    let h = history(vec![
        open.clone(),
        kill,
        section(1, 1, 7, 30, 70, "released", 101),
    ]);
    assert_eq!(check_exclusion(&h).violations.len(), 1);
    // The kill is timed from its call (`start`), not from the reading after
    // it returned (`dead`), which a descheduled caller takes late: a
    // successor granted between the two is no violation; one granted before
    // the call is.
    let timed = vec![ev(
        80,
        CONTROL,
        "fault",
        json!({"kind": "kill", "target": 0, "start": 40 * MS, "dead": 55 * MS}),
    )];
    let h = history(vec![
        open.clone(),
        timed.clone(),
        section(1, 1, 7, 45, 70, "released", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
    let h = history(vec![
        open,
        timed.clone(),
        section(1, 1, 7, 38, 70, "released", 101),
    ]);
    assert_eq!(check_exclusion(&h).violations.len(), 1);
    // A section entered while the `kill` call was under way (the signal
    // lands a moment after the call) was cut by it too, at its entry: a
    // successor after that is fine, one before it a violation. One entered
    // after the call returned was not (a kill that did not take).
    let mut late = section(0, 1, 7, 41, 10, "released", 100);
    late.truncate(3);
    let h = history(vec![
        late.clone(),
        timed.clone(),
        section(1, 1, 7, 45, 70, "released", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!((verdict.killed, verdict.unknown), (1, 0), "{verdict:?}");
    assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
    let h = history(vec![
        late,
        timed.clone(),
        section(1, 1, 7, 40, 70, "released", 101),
    ]);
    assert_eq!(check_exclusion(&h).violations.len(), 1);
    let mut after = section(0, 1, 7, 56, 10, "released", 100);
    after.truncate(3);
    let h = history(vec![
        after,
        timed,
        section(1, 1, 7, 60, 70, "released", 101),
    ]);
    let verdict = check_exclusion(&h);
    assert_eq!((verdict.killed, verdict.unknown), (0, 1), "{verdict:?}");
    assert_eq!(verdict.violations.len(), 1);
}

#[test]
fn history_skips_a_torn_last_line_but_not_a_bad_line_inside() {
    use super::history::parse_lines;
    let good = r#"{"t":1,"p":0,"e":"invoke","w":0,"s":1,"k":3,"m":"try"}"#;
    let torn = format!("{good}\n{}", &good[..20]);
    let events = parse_lines(torn.as_bytes()).expect("a torn last line is skipped");
    assert_eq!(events.len(), 1);
    let inside = format!("{}\n{good}\n", &good[..20]);
    assert_eq!(
        parse_lines(inside.as_bytes()).map(|e| e.len()),
        Err((1, good[..20].to_owned()))
    );
    // A complete last line that does not parse is not torn: an error.
    let bad = format!("{good}\nnot json\n");
    assert!(parse_lines(bad.as_bytes()).is_err());
}

#[test]
fn register_check_flags_a_lost_update() {
    let log = [
        write(0, 1, Some(1), 1),
        write(0, 2, Some(2), 2),
        write(0, 2, Some(3), 3),
    ];
    let verdict = check_register(&log, &[(0, 2)], &History::default());
    assert_eq!(verdict.lost_updates, 1);
    assert_eq!(verdict.final_mismatch, 1);
    assert!(!verdict.is_sound());
}

#[test]
fn register_check_flags_a_stale_write_accepted() {
    let log = [write(0, 1, Some(5), 1), write(0, 2, Some(4), 2)];
    let verdict = check_register(&log, &[(0, 2)], &History::default());
    assert_eq!(verdict.stale_accepted, 1);
    assert!(!verdict.is_sound());
}

#[test]
fn register_check_flags_an_acknowledged_write_missing_from_the_log() {
    let h = History::build(vec![ev(1, 0, "write", json!({"w": 0, "s": 9, "v": 1}))]);
    let verdict = check_register(&[], &[(0, 0)], &h);
    assert_eq!(verdict.acked_missing, 1);
    assert!(!verdict.is_sound());
}

/// End to end: workers that take no lock at all must be caught, by the
/// interval check and by the register.
#[test]
fn checker_catches_workers_that_take_no_lock() {
    use super::db::{TestDb, admin_options};
    use super::procs::{Fleet, RunDir};
    use super::report::Outcome;
    use super::worker::{Config, Mode};
    use std::time::Duration;

    super::scenario(async {
        let db = TestDb::create("unlocked").await;
        db.prepare(4).await;
        let dir = RunDir::new("unlocked");
        let port = admin_options().get_port();
        let configs: Vec<Config> = (0..2)
            .map(|p| Config {
                tasks: 4,
                keys: 4,
                target: 100,
                hold_us: (1_000, 5_000),
                ..Config::new(p, &dir.path, &db.name, port, Mode::Unlocked)
            })
            .collect();
        let mut fleet = Fleet::spawn(&dir.path, &configs);
        fleet.wait(Duration::from_secs(120)).await;
        let outcome = Outcome::analyse(&db, &dir.path, configs.len()).await;
        println!(
            "unlocked control: {} overlaps, {} lost updates",
            outcome.exclusion.violations.len(),
            outcome.register.lost_updates
        );
        assert!(
            !outcome.exclusion.violations.is_empty(),
            "overlaps not caught"
        );
        assert!(outcome.register.lost_updates > 0, "lost updates not caught");
        assert!(!outcome.register.is_sound());
    });
}
