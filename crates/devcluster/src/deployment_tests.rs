//! Table tests of the Deployment controller's decisions, with the cases of
//! `pkg/controller/deployment` in mind.

use super::*;

fn now() -> Timestamp {
    "2026-01-01T12:00:00Z".parse().unwrap()
}

fn ago(secs: i64) -> String {
    (now() - jiff::SignedDuration::from_secs(secs))
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn template(image: &str) -> Value {
    json!({"metadata": {"labels": {"app": "web"}},
           "spec": {"containers": [{"name": "c", "image": image}]}})
}

fn deployment(replicas: i64, image: &str, strategy: &Value) -> Deployment {
    Deployment::from_json(&json!({
        "metadata": {"name": "web", "uid": "d-uid", "resourceVersion": "10", "generation": 2,
                     "annotations": {REVISION: "1"}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                 "template": template(image), "strategy": strategy,
                 "revisionHistoryLimit": 10, "progressDeadlineSeconds": 600},
        "status": {"observedGeneration": 1},
    }))
}

fn rolling(surge: Value, unavailable: Value) -> Value {
    json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}})
}

/// A ReplicaSet of `image` at `replicas` with `available` of them
/// available, revision `rev`, created `age` seconds ago.
fn rs(name: &str, image: &str, rev: i64, replicas: i64, available: i64, age: i64) -> ReplicaSet {
    let mut t = template(image);
    t["metadata"]["labels"][POD_TEMPLATE_HASH] = json!(name);
    ReplicaSet::from_json(&json!({
        "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "5", "generation": 1,
                     "creationTimestamp": ago(age),
                     "annotations": {REVISION: rev.to_string()}},
        "spec": {"replicas": replicas, "template": t},
        "status": {"replicas": replicas, "readyReplicas": available, "availableReplicas": available,
                   "observedGeneration": 1},
    }))
}

fn run(d: Deployment, rss: Vec<ReplicaSet>) -> Vec<Action> {
    sync(Input {
        deployment: d,
        replica_sets: rss,
        live_pods: HashMap::new(),
        now: now(),
    })
}

/// `(name, replicas)` of every ReplicaSet write, in order (creates named `new`).
fn scalings(actions: &[Action]) -> Vec<(String, i64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::CreateReplicaSet(rs) => {
                Some(("new".to_owned(), rs["spec"]["replicas"].as_i64().unwrap()))
            }
            Action::UpdateReplicaSet { name, replicas, .. } => Some((name.clone(), *replicas)),
            _ => None,
        })
        .collect()
}

fn events(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, message, .. } => Some(format!("{reason}: {message}")),
            _ => None,
        })
        .collect()
}

fn final_status(actions: &[Action]) -> Value {
    actions
        .iter()
        .rev()
        .find_map(|a| match a {
            Action::UpdateStatus { status, .. } => Some(status.clone()),
            _ => None,
        })
        .expect("a status write")
}

fn condition(status: &Value, type_: &str) -> (String, String) {
    let c = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} in {status}"));
    (
        c["status"].as_str().unwrap().to_owned(),
        c["reason"].as_str().unwrap().to_owned(),
    )
}

#[test]
fn fenceposts_round_surge_up_and_unavailability_down() {
    let cases = [
        // (replicas, surge, unavailable) -> (surge, unavailable)
        (4, json!("25%"), json!("25%"), (1, 1)),
        (3, json!("25%"), json!("25%"), (1, 0)),
        (1, json!("25%"), json!("25%"), (1, 0)),
        (10, json!("25%"), json!("25%"), (3, 2)),
        (10, json!(3), json!("0%"), (3, 0)),
        (10, json!("0%"), json!("0%"), (0, 1)),
        (2, json!("1%"), json!("0%"), (1, 0)),
        (2, json!(0), json!("1%"), (0, 1)),
        (5, json!(0), json!(9), (0, 9)),
    ];
    for (replicas, surge, unavailable, want) in cases {
        let d = deployment(replicas, "v1", &rolling(surge.clone(), unavailable.clone()));
        assert_eq!(d.fenceposts(), want, "{replicas} {surge} {unavailable}");
    }
    let d = deployment(5, "v1", &rolling(json!(0), json!(9)));
    assert_eq!(d.max_unavailable(), 5, "never more than the replicas");
    let r = deployment(5, "v1", &json!({"type": "Recreate"}));
    assert_eq!((r.max_surge(), r.max_unavailable()), (0, 0));
    let defaulted = Deployment::from_json(&json!({"spec": {"replicas": 8}}));
    assert_eq!(defaulted.fenceposts(), (2, 2), "absent strategy: 25%/25%");
}

#[test]
fn a_new_deployment_creates_its_first_replica_set_at_full_size() {
    let mut d = deployment(3, "v1", &rolling(json!("25%"), json!("25%")));
    d.annotations.clear();
    d.annotations.insert("team".into(), "a".into());
    let actions = run(d, vec![]);
    let Action::CreateReplicaSet(created) = &actions[0] else {
        panic!("{actions:?}")
    };
    let name = created["metadata"]["name"].as_str().unwrap();
    let hash = created["metadata"]["labels"][POD_TEMPLATE_HASH].as_str().unwrap();
    assert_eq!(name, format!("web-{hash}"));
    assert_eq!(created["spec"]["replicas"], 3);
    assert_eq!(
        created["spec"]["selector"]["matchLabels"][POD_TEMPLATE_HASH],
        hash
    );
    assert_eq!(
        created["spec"]["template"]["metadata"]["labels"][POD_TEMPLATE_HASH],
        hash
    );
    assert_eq!(
        created["metadata"]["annotations"],
        json!({REVISION: "1", DESIRED_REPLICAS: "3", MAX_REPLICAS: "4", "team": "a"})
    );
    assert_eq!(created["metadata"]["ownerReferences"][0]["uid"], "d-uid");
    assert_eq!(
        events(&actions),
        [format!(
            "ScalingReplicaSet: Scaled up replica set {name} from 0 to 3"
        )]
    );
    let Some(Action::UpdateStatus {
        annotations, status, ..
    }) = actions.last()
    else {
        panic!("{actions:?}")
    };
    assert_eq!(annotations[REVISION], "1");
    assert_eq!(status["observedGeneration"], 2);
    assert_eq!(
        status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["type"].as_str().unwrap(), c["reason"].as_str().unwrap()))
            .collect::<Vec<_>>(),
        [
            ("Progressing", "NewReplicaSetCreated"),
            ("Available", "MinimumReplicasUnavailable")
        ]
    );
    assert_eq!(
        status["conditions"][0]["message"],
        format!("Created new replica set {name:?}")
    );
}

#[test]
fn rolling_updates_move_within_surge_and_unavailability() {
    // (what, replicas, surge, unavailable, old (replicas, available), new (replicas, available)
    //  or None, expected writes)
    type Case = (
        &'static str,
        i64,
        Value,
        Value,
        (i64, i64),
        Option<(i64, i64)>,
        Vec<(&'static str, i64)>,
    );
    let cases: Vec<Case> = vec![
        (
            "surge 1, unavailable 0: one new pod, every old pod stays",
            3,
            json!(1),
            json!(0),
            (3, 0),
            None,
            vec![("new", 1)],
        ),
        (
            "the new pod not available yet: nothing more",
            3,
            json!(1),
            json!(0),
            (3, 3),
            Some((1, 0)),
            vec![],
        ),
        (
            "the new pod available: one old pod goes",
            3,
            json!(1),
            json!(0),
            (3, 3),
            Some((1, 1)),
            vec![("old", 2)],
        ),
        (
            "then the next new pod",
            3,
            json!(1),
            json!(0),
            (2, 2),
            Some((1, 1)),
            vec![("new-rs", 2)],
        ),
        (
            "surge 0, unavailable 1: the new set starts empty, an old pod goes first",
            3,
            json!(0),
            json!(1),
            (3, 3),
            None,
            vec![("new", 0), ("old", 2)],
        ),
        (
            "unavailable old pods are cleaned up first",
            4,
            json!(1),
            json!(1),
            (4, 1),
            Some((1, 0)),
            vec![("old", 3)],
        ),
        (
            "25%/25% of 4: one up and one down",
            4,
            json!("25%"),
            json!("25%"),
            (4, 4),
            None,
            vec![("new", 1), ("old", 3)],
        ),
        (
            "the rollout completes: the old set goes to zero",
            4,
            json!("25%"),
            json!("25%"),
            (1, 1),
            Some((4, 4)),
            vec![("old", 0)],
        ),
        (
            "a new set above the desired size shrinks",
            2,
            json!(1),
            json!(0),
            (0, 0),
            Some((3, 3)),
            vec![("new-rs", 2)],
        ),
    ];
    for (what, replicas, surge, unavailable, (old_n, old_avail), new, want) in cases {
        let d = deployment(replicas, "v2", &rolling(surge, unavailable));
        let mut rss = vec![rs("old", "v1", 1, old_n, old_avail, 100)];
        if let Some((n, avail)) = new {
            rss.push(rs("new-rs", "v2", 2, n, avail, 10));
        }
        let got = scalings(&run(d, rss));
        let want: Vec<(String, i64)> = want.into_iter().map(|(n, r)| (n.to_owned(), r)).collect();
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn the_status_counts_every_replica_set_and_names_progress() {
    let d = deployment(3, "v2", &rolling(json!(1), json!(0)));
    let actions = run(
        d,
        vec![rs("old", "v1", 1, 3, 3, 100), rs("new-rs", "v2", 2, 1, 0, 10)],
    );
    let status = final_status(&actions);
    assert_eq!(status["replicas"], 4);
    assert_eq!(status["updatedReplicas"], 1);
    assert_eq!(status["availableReplicas"], 3);
    assert_eq!(status["readyReplicas"], 3);
    assert_eq!(status["unavailableReplicas"], 1);
    assert_eq!(
        condition(&status, "Available"),
        ("True".into(), "MinimumReplicasAvailable".into())
    );
    assert_eq!(
        condition(&status, "Progressing"),
        ("True".into(), "ReplicaSetUpdated".into())
    );

    // Complete: every pod updated and available.
    let mut d = deployment(3, "v2", &rolling(json!(1), json!(0)));
    d.status = DeploymentStatus::from_json(&final_status(&actions));
    d.status.observed_generation = 2;
    let done = run(
        d,
        vec![rs("old", "v1", 1, 0, 0, 100), rs("new-rs", "v2", 2, 3, 3, 10)],
    );
    let status = final_status(&done);
    assert_eq!(
        condition(&status, "Progressing"),
        ("True".into(), "NewReplicaSetAvailable".into())
    );
    assert_eq!(
        status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Progressing")
            .unwrap()["message"],
        "ReplicaSet \"new-rs\" has successfully progressed."
    );
    assert!(
        status.get("unavailableReplicas").is_none(),
        "zero counts are left out"
    );
}

#[test]
fn no_progress_within_the_deadline_times_out() {
    let mut d = deployment(3, "v2", &rolling(json!(1), json!(0)));
    d.progress_deadline_seconds = Some(60);
    let rss = || vec![rs("old", "v1", 1, 3, 3, 1000), rs("new-rs", "v2", 2, 1, 0, 900)];
    let mut status = DeploymentStatus {
        observed_generation: 2,
        replicas: 4,
        updated_replicas: 1,
        ready_replicas: 3,
        available_replicas: 3,
        unavailable_replicas: 1,
        terminating_replicas: None,
        collision_count: None,
        conditions: vec![Condition::new(
            "Progressing",
            "True",
            reason::REPLICA_SET_UPDATED,
            "ReplicaSet \"new-rs\" is progressing.".into(),
            &ago(30),
        )],
    };
    d.status = status.clone();
    let within = run(d.clone(), rss());
    assert!(
        within.iter().all(|a| match a {
            Action::UpdateStatus { status, .. } => condition(status, "Progressing").1 == "ReplicaSetUpdated",
            _ => true,
        }),
        "{within:?}"
    );
    status.conditions[0].last_update = ago(61);
    d.status = status;
    let late = final_status(&run(d, rss()));
    assert_eq!(
        condition(&late, "Progressing"),
        ("False".into(), "ProgressDeadlineExceeded".into())
    );
}

#[test]
fn recreate_removes_every_old_pod_before_the_first_new_one() {
    let recreate = json!({"type": "Recreate"});
    let d = deployment(3, "v2", &recreate);
    assert_eq!(
        scalings(&run(d.clone(), vec![rs("old", "v1", 1, 3, 3, 100)])),
        [("old".to_owned(), 0)]
    );
    // Scaled to zero but pods still there: wait.
    let mut old = rs("old", "v1", 1, 0, 0, 100);
    old.status.replicas = 2;
    assert!(scalings(&run(d.clone(), vec![old.clone()])).is_empty());
    old.status.replicas = 0;
    let actions = sync(Input {
        deployment: d.clone(),
        replica_sets: vec![old.clone()],
        live_pods: [("uid-old".to_owned(), 1)].into(),
        now: now(),
    });
    assert!(
        scalings(&actions).is_empty(),
        "a terminating old pod holds the new set back"
    );
    assert_eq!(scalings(&run(d, vec![old])), [("new".to_owned(), 3)]);
}

#[test]
fn a_paused_deployment_scales_but_does_not_roll_out() {
    let mut d = deployment(5, "v2", &rolling(json!(1), json!(0)));
    d.paused = true;
    let actions = run(d.clone(), vec![rs("old", "v1", 1, 3, 3, 100)]);
    assert_eq!(scalings(&actions), [("old".to_owned(), 5)], "scaled, no new set");
    assert_eq!(
        condition(&final_status(&actions), "Progressing"),
        ("Unknown".into(), "DeploymentPaused".into())
    );
    d.paused = false;
    d.status = DeploymentStatus::from_json(&final_status(&actions));
    let resumed = run(d, vec![rs("old", "v1", 1, 5, 5, 100)]);
    assert_eq!(scalings(&resumed), [("new".to_owned(), 1)]);
    assert_eq!(condition(&final_status(&resumed), "Progressing").0, "True");
}

#[test]
fn scaling_during_a_rollout_is_proportional() {
    let d = deployment(20, "v3", &rolling(json!(3), json!(2)));
    let mut old = rs("old", "v1", 1, 8, 8, 100);
    let mut new = rs("new-rs", "v3", 2, 5, 0, 10);
    for r in [&mut old, &mut new] {
        r.annotations.insert(DESIRED_REPLICAS.into(), "10".into());
        r.annotations.insert(MAX_REPLICAS.into(), "13".into());
    }
    let actions = run(d, vec![old, new]);
    assert_eq!(
        scalings(&actions),
        [("old".to_owned(), 14), ("new-rs".to_owned(), 9)],
        "23 pods allowed, split 8:5"
    );
    let Action::UpdateReplicaSet { annotations, .. } = &actions[0] else {
        panic!()
    };
    assert_eq!(
        (&annotations[DESIRED_REPLICAS][..], &annotations[MAX_REPLICAS][..]),
        ("20", "23")
    );
}

#[test]
fn returning_to_an_old_template_revives_its_replica_set_with_a_new_revision() {
    let d = deployment(2, "v1", &rolling(json!(1), json!(0)));
    let actions = run(
        d,
        vec![rs("first", "v1", 1, 0, 0, 100), rs("second", "v2", 2, 2, 2, 50)],
    );
    let Action::UpdateReplicaSet {
        name, annotations, ..
    } = &actions[0]
    else {
        panic!("{actions:?}")
    };
    assert_eq!(name, "first");
    assert_eq!(annotations[REVISION], "3");
    assert_eq!(annotations[REVISION_HISTORY], "1");
    assert!(actions.iter().all(|a| !matches!(a, Action::CreateReplicaSet(_))));
}

#[test]
fn a_rollback_annotation_restores_that_revision_template() {
    let mut d = deployment(2, "v3", &rolling(json!(1), json!(0)));
    d.annotations.insert(ROLLBACK_TO.into(), "1".into());
    let actions = run(
        d,
        vec![
            rs("first", "v1", 1, 0, 0, 100),
            rs("second", "v2", 2, 0, 0, 50),
            rs("third", "v3", 3, 2, 2, 10),
        ],
    );
    let Some(Action::UpdateDeployment {
        template,
        annotations,
        ..
    }) = actions
        .iter()
        .find(|a| matches!(a, Action::UpdateDeployment { .. }))
    else {
        panic!("{actions:?}")
    };
    assert_eq!(template["spec"]["containers"][0]["image"], "v1");
    assert!(template["metadata"]["labels"].get(POD_TEMPLATE_HASH).is_none());
    assert!(!annotations.contains_key(ROLLBACK_TO));
    assert_eq!(
        events(&actions).last().unwrap(),
        "DeploymentRollback: Rolled back deployment \"web\" to revision 1"
    );
}

#[test]
fn old_replica_sets_beyond_the_history_limit_are_deleted_oldest_first() {
    let mut d = deployment(1, "v4", &rolling(json!(1), json!(0)));
    d.revision_history_limit = Some(1);
    d.status = DeploymentStatus {
        observed_generation: 2,
        replicas: 1,
        updated_replicas: 1,
        available_replicas: 1,
        ready_replicas: 1,
        ..DeploymentStatus::default()
    };
    let mut busy = rs("busy", "v0", 1, 0, 0, 400);
    busy.status.replicas = 1;
    let actions = run(
        d,
        vec![
            busy,
            rs("first", "v1", 2, 0, 0, 300),
            rs("second", "v2", 3, 0, 0, 200),
            rs("third", "v3", 4, 0, 0, 100),
            rs("current", "v4", 5, 1, 1, 10),
        ],
    );
    let deleted: Vec<&str> = actions
        .iter()
        .filter_map(|a| match a {
            Action::DeleteReplicaSet { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(deleted, ["first", "second"], "one kept; one with pods left alone");
}

#[test]
fn a_settled_deployment_writes_nothing() {
    let d = deployment(2, "v1", &rolling(json!(1), json!(0)));
    let first = run(d.clone(), vec![rs("only", "v1", 1, 2, 2, 100)]);
    let mut settled = d;
    settled.status = DeploymentStatus::from_json(&final_status(&first));
    if let Some(Action::UpdateStatus { annotations, .. }) = first.last() {
        settled.annotations = annotations.clone();
    }
    let mut only = rs("only", "v1", 1, 2, 2, 100);
    only.annotations.insert(MAX_REPLICAS.into(), "3".into());
    let again = run(settled, vec![only]);
    assert!(again.is_empty(), "{again:?}");
}

#[test]
fn hashes_and_names_look_like_the_controllers() {
    let h = template_hash(&template("v1"), None);
    assert!(
        h.len() >= 8 && h.chars().all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c)),
        "{h}"
    );
    assert_eq!(h, template_hash(&template("v1"), None), "stable");
    assert_ne!(h, template_hash(&template("v2"), None));
    assert_ne!(h, template_hash(&template("v1"), Some(1)), "collisions change it");
    let long = "a".repeat(300);
    let name = replica_set_name(&long, &h);
    assert_eq!(name.len(), 253);
    assert!(name.ends_with(&format!("-{h}")));
    let mut with_hash = template("v1");
    with_hash["metadata"]["labels"][POD_TEMPLATE_HASH] = json!(h);
    with_hash["metadata"]["annotations"] = json!({});
    assert!(equal_ignore_hash(&with_hash, &template("v1")));
    assert!(!equal_ignore_hash(&template("v2"), &template("v1")));
}
