use super::*;

const A: &[u8] = b"\"a\"";
const B: &[u8] = b"\"b\"";
const NONE: Own<'static> = Own {
    if_match: Sent::Absent,
    if_none_match: Sent::Absent,
};

/// The plain write of `op` (its answer shows the key's state).
fn plain(op: Operation) -> Classified {
    Classified { op, plain: true }
}

fn tag(t: &[u8]) -> KeyState {
    KeyState::Tagged(Bytes::copy_from_slice(t))
}

fn ok(status: u16, etag: Option<&[u8]>) -> Answer<'_> {
    Answer::Storage {
        status,
        etag,
        code: None,
    }
}

fn coded(status: u16, code: &[u8]) -> Answer<'_> {
    Answer::Storage {
        status,
        etag: None,
        code: Some(code),
    }
}

/// A `GET` of the key, as `states` would plan it.
fn read(states: &KeyStates) -> Exchange {
    states.read("GET", None)
}

fn put(s: &mut KeyStates, key: &str) -> (Plan, Exchange) {
    s.plan_write(key, plain(Operation::Write), &NONE, true)
}

fn delete(s: &mut KeyStates, key: &str) -> (Plan, Exchange) {
    s.plan_write(key, plain(Operation::Delete), &NONE, true)
}

fn own(if_match: Option<&'static [u8]>, if_none_match: Option<&'static [u8]>) -> Own<'static> {
    Own {
        if_match: if_match.map_or(Sent::Absent, Sent::One),
        if_none_match: if_none_match.map_or(Sent::Absent, Sent::One),
    }
}

#[test]
fn an_unknown_key_is_refused_until_read() {
    let mut s = KeyStates::new(16);
    assert_eq!(put(&mut s, "/k").0, Plan::Required(Required::Unknown));
    s.learn("/k", &read(&s), ok(404, None));
    assert_eq!(put(&mut s, "/k").0, Plan::IfNoneMatchAny);
    s.learn("/k", &read(&s), ok(200, Some(A)));
    assert_eq!(put(&mut s, "/k").0, Plan::IfMatch(Bytes::from_static(A)));
}

#[test]
fn writes_teach_the_state_they_leave() {
    let mut s = KeyStates::new(16);
    s.learn("/k", &read(&s), ok(404, None));
    let (plan, ex) = put(&mut s, "/k");
    assert_eq!(plan, Plan::IfNoneMatchAny);
    s.learn("/k", &ex, ok(201, Some(A)));
    assert_eq!(s.known("/k"), Some(&tag(A)));
    let (plan, ex) = delete(&mut s, "/k");
    assert_eq!(plan, Plan::IfMatch(Bytes::from_static(A)));
    s.learn("/k", &ex, ok(204, None));
    assert_eq!(s.known("/k"), Some(&KeyState::Absent));
    // An applied write whose answer names no state: forgotten.
    s.learn("/k", &read(&s), ok(200, Some(A)));
    let (_, ex) = put(&mut s, "/k");
    s.learn("/k", &ex, ok(200, None));
    assert_eq!(s.known("/k"), None);
    // A weak tag names nothing a write can be conditioned on.
    s.learn("/k", &read(&s), ok(200, Some(b"W/\"a\"")));
    assert_eq!(s.known("/k"), None);
    // A delete (with its own If-Match) that found nothing leaves it absent.
    let (_, ex) = s.plan_write("/k", plain(Operation::Delete), &own(Some(A), None), true);
    s.learn("/k", &ex, ok(404, None));
    assert_eq!(s.known("/k"), Some(&KeyState::Absent));
}

/// The first shape: a DELETE of a key seen absent went with
/// `If-None-Match: *`, which S3's DeleteObject ignores, so a late one
/// removed a later term's object (seen failing with the old plan, and
/// with the mutant `delete-of-absent-conditioned`).
#[test]
fn a_delete_of_a_key_seen_absent_is_refused() {
    for how in ["read 404", "a delete that succeeded"] {
        let mut s = KeyStates::new(16);
        s.learn("/k", &read(&s), ok(200, Some(A)));
        if how == "read 404" {
            s.learn("/k", &read(&s), ok(404, None));
        } else {
            let (_, ex) = delete(&mut s, "/k");
            s.learn("/k", &ex, ok(204, None));
        }
        assert_eq!(s.known("/k"), Some(&KeyState::Absent), "{how}");
        for op in [Operation::Delete, Operation::DeleteVersion] {
            let (plan, ex) = s.plan_write("/k", plain(op), &NONE, true);
            assert_eq!(plan, Plan::Required(Required::DeleteOfAbsent), "{how}");
            assert!(!ex.teaches());
        }
        // A PUT of it goes on its absence.
        assert_eq!(put(&mut s, "/k").0, Plan::IfNoneMatchAny);
    }
}

#[test]
fn own_preconditions_go_only_where_the_storage_compares_them() {
    let mut s = KeyStates::new(16);
    let (plan, ex) = s.plan_write("/k", plain(Operation::Write), &own(None, Some(b"*")), true);
    assert_eq!(plan, Plan::AsSent);
    s.learn("/k", &ex, ok(200, Some(A)));
    assert_eq!(s.known("/k"), Some(&tag(A)));
    let (plan, ex) = s.plan_write("/k", plain(Operation::Write), &own(Some(B), None), true);
    assert_eq!(plan, Plan::AsSent);
    s.learn("/k", &ex, ok(412, None));
    assert_eq!(s.known("/k"), None);
    // The fourth shape: each protects nothing, each is refused
    // (all three landed late before).
    for (op, own, why) in [
        (
            Operation::Write,
            own(None, Some(b"\"x\"")),
            Unprotected::NoneMatchNotAny,
        ),
        (
            Operation::Write,
            own(Some(b""), None),
            Unprotected::NotOneTag,
        ),
        (
            Operation::Delete,
            own(Some(b"*"), None),
            Unprotected::NotOneTag,
        ),
        (
            Operation::Delete,
            own(None, Some(b"*")),
            Unprotected::NoneMatchOnDelete,
        ),
    ] {
        let (plan, ex) = s.plan_write("/k", plain(op), &own, true);
        assert_eq!(plan, Plan::Required(Required::Unprotected(why)), "{own:?}");
        assert!(!ex.teaches());
    }
}

#[test]
fn refusals_and_unknown_outcomes_forget_the_state_they_named() {
    for answer in [ok(412, None), ok(409, None), ok(500, None), Answer::Unknown] {
        let mut s = KeyStates::new(16);
        s.learn("/k", &read(&s), ok(200, Some(A)));
        let (_, ex) = put(&mut s, "/k");
        s.learn("/k", &ex, answer);
        assert_eq!(s.known("/k"), None, "{answer:?}");
        // One named a state since replaced: the newer one stays.
        s.learn("/k", &read(&s), ok(200, Some(A)));
        let (_, first) = put(&mut s, "/k");
        let (_, second) = put(&mut s, "/k");
        s.learn("/k", &second, ok(200, Some(B)));
        s.learn("/k", &first, answer);
        assert_eq!(s.known("/k"), Some(&tag(B)), "{answer:?}");
    }
}

#[test]
fn aside_writes_go_as_sent_and_teach_nothing() {
    let mut s = KeyStates::new(16);
    s.learn("/k", &read(&s), ok(200, Some(A)));
    let (plan, ex) = s.plan_write("/k", plain(Operation::Aside), &NONE, true);
    assert_eq!((plan, ex.teaches()), (Plan::AsSent, false));
    // A part's answer carries the part's tag, not the key's.
    s.learn("/k", &ex, ok(200, Some(B)));
    assert_eq!(s.known("/k"), Some(&tag(A)));
    // Whatever it carries of its own.
    let (plan, _) = s.plan_write("/k", plain(Operation::Aside), &own(Some(b"*"), None), true);
    assert_eq!(plan, Plan::AsSent);
}

#[test]
fn a_delete_of_a_version_teaches_nothing() {
    let mut s = KeyStates::new(16);
    s.learn("/k", &read(&s), ok(200, Some(A)));
    let (plan, ex) = s.plan_write("/k", plain(Operation::DeleteVersion), &NONE, true);
    assert_eq!(plan, Plan::IfMatch(Bytes::from_static(A)));
    s.learn("/k", &ex, ok(204, None));
    assert_eq!(s.known("/k"), None, "an older version may be current now");
}

#[test]
fn a_signature_over_the_headers_gets_the_state_to_send() {
    let mut s = KeyStates::new(16);
    s.learn("/k", &read(&s), ok(200, Some(A)));
    let (plan, ex) = s.plan_write("/k", plain(Operation::Write), &NONE, false);
    assert_eq!(plan, Plan::Required(Required::Send(tag(A))));
    assert!(!ex.teaches());
}

#[test]
fn reads_of_other_versions_teach_nothing() {
    let mut s = KeyStates::new(16);
    for query in ["versionId=1", "version%49d=1", "x=1"] {
        let ex = s.read("GET", Some(query));
        assert!(!ex.teaches(), "{query}");
        s.learn("/k", &ex, ok(404, None));
    }
    s.learn("/k", &read(&s), ok(403, Some(A)));
    s.learn("/k", &read(&s), ok(500, None));
    assert_eq!(s.known("/k"), None);
}

/// The third shape: S3 answers a read of a missing version 404
/// `NoSuchVersion`, which says nothing about the key (seen failing with
/// the 404 taken as "absent" whatever its code).
#[test]
fn absent_is_learned_only_from_an_answer_that_says_so() {
    assert_eq!(
        error_code(b"<?xml version=\"1.0\"?>\n<Error><Code>NoSuchVersion</Code><Message>"),
        Some(&b"NoSuchVersion"[..])
    );
    assert_eq!(
        error_code(b"<Error><Code> NoSuchKey </Code>"),
        Some(&b"NoSuchKey"[..])
    );
    assert_eq!(error_code(b"<Error><Code>NoSu"), Some(&b"NoSu"[..]));
    assert_eq!(error_code(b"{\"reason\":\"not-found\"}"), None);
    assert!(says_absent(None));
    assert!(says_absent(Some(b"NoSuchKey")));
    assert!(says_absent(Some(b"BlobNotFound")));
    for other in [
        &b"NoSuchVersion"[..],
        b"NoSuchUpload",
        b"NoSuchBucket",
        b"NoSu",
    ] {
        assert!(!says_absent(Some(other)));
    }
    let mut s = KeyStates::new(16);
    s.learn("/k", &read(&s), ok(200, Some(A)));
    for code in [&b"NoSuchVersion"[..], b"NoSuchUpload", b"NoSuchBucket"] {
        let ex = read(&s);
        assert!(ex.needs_code(404));
        s.learn("/k", &ex, coded(404, code));
        assert_eq!(s.known("/k"), Some(&tag(A)));
        let (_, ex) = delete(&mut s, "/k");
        assert!(ex.needs_code(404));
        s.learn("/k", &ex, coded(404, code));
        assert_ne!(s.known("/k"), Some(&KeyState::Absent));
        s.learn("/k", &read(&s), ok(200, Some(A)));
    }
    s.learn("/k", &read(&s), coded(404, b"NoSuchKey"));
    assert_eq!(s.known("/k"), Some(&KeyState::Absent));
    assert!(!read(&s).needs_code(200));
    // A HEAD's 404 has no body: absent, at once.
    assert!(!s.read("HEAD", None).needs_code(404));
    assert!(!put(&mut s, "/k").1.needs_code(404));
}

#[test]
fn memory_is_bounded_and_recent_keys_stay() {
    let mut s = KeyStates::new(100);
    s.learn("/hot", &read(&s), ok(200, Some(A)));
    for i in 0..10_000 {
        let key = format!("/k{i}");
        s.learn(&key, &read(&s), ok(404, None));
        assert!(s.len() <= s.capacity());
        if i % 10 == 0 {
            assert_eq!(put(&mut s, "/hot").0, Plan::IfMatch(Bytes::from_static(A)));
        }
    }
    assert_eq!(s.capacity(), 100);
    assert!(s.known("/k9999").is_some());
    assert!(s.known("/k0").is_none());
    s.take_over();
    assert!(s.is_empty());
}

/// Reads need no credential: a flood of reads of distinct keys must not
/// push out the keys writers use (seen failing with one table for both:
/// the writer's key was gone after capacity reads).
#[test]
fn reads_cannot_push_out_the_keys_writers_use() {
    let mut s = KeyStates::new(100);
    // Writers' keys: one learned by a write, one read and then written.
    s.learn("/w1", &read(&s), ok(404, None));
    let (_, ex) = put(&mut s, "/w1");
    s.learn("/w1", &ex, ok(200, Some(A)));
    s.learn("/w2", &read(&s), ok(200, Some(B)));
    assert_eq!(put(&mut s, "/w2").0, Plan::IfMatch(Bytes::from_static(B)));
    for i in 0..100_000 {
        let key = format!("/flood{i}");
        s.learn(&key, &read(&s), ok(404, None));
        assert!(s.len() <= s.capacity());
    }
    assert_eq!(s.known("/w1"), Some(&tag(A)));
    assert_eq!(s.known("/w2"), Some(&tag(B)));
    // A read of a writer's key updates it where it is.
    s.learn("/w1", &read(&s), ok(200, Some(B)));
    for i in 0..100_000 {
        s.learn(&format!("/again{i}"), &read(&s), ok(404, None));
    }
    assert_eq!(s.known("/w1"), Some(&tag(B)));
}

#[test]
fn a_new_primacy_learns_nothing_from_the_old_one() {
    let mut s = KeyStates::new(16);
    let before = read(&s);
    let (_, write) = s.plan_write("/w", plain(Operation::Write), &own(None, Some(b"*")), true);
    s.take_over();
    s.learn("/k", &before, ok(200, Some(A)));
    s.learn("/w", &write, ok(200, Some(B)));
    assert!(s.is_empty());
    s.learn("/k", &read(&s), ok(200, Some(A)));
    assert_eq!(s.known("/k"), Some(&tag(A)));
}

#[test]
fn strong_tags() {
    assert_eq!(strong_tag(b"\"abc\""), Some(&b"\"abc\""[..]));
    assert_eq!(strong_tag(b"\"\""), Some(&b"\"\""[..]));
    for bad in [
        &b"W/\"a\""[..],
        b"abc",
        b"\"a",
        b"\"a\"b\"",
        b"\"",
        b"\"a b\"",
    ] {
        assert_eq!(strong_tag(bad), None, "{:?}", String::from_utf8_lossy(bad));
    }
}

/// A write that is not the plain write of its key (a part's upload with a
/// parameter fencegate does not know, which moto executed as UploadPart)
/// teaches nothing from its answer: the tag it carries is the part's
/// (seen failing: the next PUT went with the part's tag).
#[test]
fn only_the_plain_write_teaches() {
    let mut s = KeyStates::new(16);
    s.learn("/k", &read(&s), ok(200, Some(A)));
    let part = Classified {
        op: Operation::Write,
        plain: false,
    };
    let (plan, ex) = s.plan_write("/k", part, &NONE, true);
    assert_eq!(plan, Plan::IfMatch(Bytes::from_static(A)));
    s.learn("/k", &ex, ok(200, Some(B)));
    assert_eq!(s.known("/k"), None);
    // Nor does a DELETE with more than neutral parameters.
    s.learn("/k", &read(&s), ok(200, Some(A)));
    let odd_delete = Classified {
        op: Operation::Delete,
        plain: false,
    };
    let (_, ex) = s.plan_write("/k", odd_delete, &NONE, true);
    assert!(!ex.needs_code(404));
    s.learn("/k", &ex, ok(204, None));
    assert_eq!(s.known("/k"), None);
}

/// An operation the storage evaluates no precondition on, though it
/// changes the key (Azure's Undelete Blob): refused, whatever it carries.
#[test]
fn an_unconditional_operation_is_refused() {
    let mut s = KeyStates::new(16);
    s.learn("/k", &read(&s), ok(200, Some(A)));
    for own in [NONE, own(Some(A), None)] {
        let (plan, ex) = s.plan_write("/k", plain(Operation::Unconditional), &own, true);
        assert_eq!(plan, Plan::Required(Required::NotEvaluated));
        assert!(!ex.teaches());
    }
}
