"""The sans-I/O half of the pod watcher: which annotation values are valid, and which control
requests bring the scheduler to what the node's pods ask for."""

from __future__ import annotations

import pytest

from nvshare_py.deviceplugin.podsettings import (MEMORY_LIMIT, MIRROR_ANNOTATION, PRIORITY, WEIGHT, PodSettings,
                                                 Request, read_pod)

UID = "0d6c4f4e-2b1a-4b8e-9c3d-5e6f7a8b9c0d"
OTHER = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"


def pod(annotations: dict | None = None, uid: str = UID, name: str = "nb-0", phase: str = "Running") -> dict:
    return {"metadata": {"uid": uid, "name": name, "namespace": "team-a", "annotations": annotations or {}},
            "status": {"phase": phase}}


@pytest.mark.parametrize("annotation, text, value", [
    (WEIGHT, "1", 1), (WEIGHT, "1000", 1000), (WEIGHT, " 4 ", 4),
    (PRIORITY, "0", 0), (PRIORITY, "7", 7),
    (MEMORY_LIMIT, "8Gi", 8 << 30), (MEMORY_LIMIT, "8G", 8 << 30), (MEMORY_LIMIT, "512Mi", 512 << 20),
    (MEMORY_LIMIT, "1.5GiB", 3 << 29), (MEMORY_LIMIT, "1048576", 1 << 20),
])
def test_valid_annotation_values(annotation, text, value):
    read = read_pod(pod({annotation: text}))
    assert read.values == {annotation: value} and read.problems == ()


@pytest.mark.parametrize("annotation, text", [
    (WEIGHT, "0"), (WEIGHT, "1001"), (WEIGHT, "-3"), (WEIGHT, "2.5"), (WEIGHT, "heavy"), (WEIGHT, ""), (WEIGHT, "\u0663"),
    (PRIORITY, "8"), (PRIORITY, "-1"), (PRIORITY, "high"),
    (MEMORY_LIMIT, "0"), (MEMORY_LIMIT, "lots"), (MEMORY_LIMIT, "8Gx"), (MEMORY_LIMIT, "-1Gi"), (MEMORY_LIMIT, ""),
])
def test_bad_values_are_problems_naming_pod_annotation_and_value(annotation, text):
    read = read_pod(pod({annotation: text, WEIGHT if annotation != WEIGHT else PRIORITY: "3"}))
    assert annotation not in read.values and len(read.values) == 1  # the valid neighbour stays
    (problem,) = read.problems
    assert (problem.pod, problem.annotation, problem.value) == ("team-a/nb-0", annotation, text)
    assert f"team-a/nb-0: {annotation}={text!r} ignored: " in str(problem)


def test_other_annotations_are_not_settings_and_finished_pods_ask_for_nothing():
    assert read_pod(pod({"nvshare.com/colour": "blue", "example.com/weight": "3"})).values == {}
    assert read_pod(pod({WEIGHT: "3"}, phase="Succeeded")).values == {}
    assert read_pod(pod({WEIGHT: "3"}, phase="Failed")).values == {}
    assert read_pod({"metadata": {"name": "no-uid"}}) is None


def test_a_static_pods_settings_go_to_the_uid_its_containers_run_under():
    # The mirror pod in the API has a UID of its own; the kubelet's is in the annotation.
    static = "2b3c4d5e6f708192a3b4c5d6e7f80912"
    assert read_pod(pod({WEIGHT: "2", MIRROR_ANNOTATION: static})).uid == static


def test_requests_follow_the_control_contract():
    assert Request(UID, "team-a/nb-0", WEIGHT, 4).op == "set-weight"
    assert Request(UID, "team-a/nb-0", WEIGHT, 4).fields == {"pod_uid": UID, "weight": 4}
    assert Request(UID, "team-a/nb-0", PRIORITY, None).fields == {"pod_uid": UID, "priority": None}
    assert Request(UID, "team-a/nb-0", MEMORY_LIMIT, 1 << 30).op == "set-limit"
    assert Request(UID, "team-a/nb-0", MEMORY_LIMIT, 1 << 30).fields == {"pod_uid": UID, "bytes": 1 << 30}


def settle(settings: PodSettings) -> list[tuple[str, str, int | None]]:
    """Sends everything pending (as the shell does when the scheduler answers)."""
    sent = []
    for request in settings.pending():
        sent.append((request.pod_uid, request.annotation, request.value))
        settings.told(request)
    assert settings.pending() == []
    return sent


def test_changes_of_a_pod_become_sets_and_removals():
    settings = PodSettings()
    settings.update(read_pod(pod({WEIGHT: "4", MEMORY_LIMIT: "1Gi"})))
    assert sorted(settle(settings)) == [(UID, MEMORY_LIMIT, 1 << 30), (UID, WEIGHT, 4)]
    settings.update(read_pod(pod({WEIGHT: "4", MEMORY_LIMIT: "1Gi"})))  # unrelated change of the pod
    assert settle(settings) == []
    settings.update(read_pod(pod({WEIGHT: "5", PRIORITY: "2"})))
    assert settle(settings) == [(UID, MEMORY_LIMIT, None), (UID, WEIGHT, 5), (UID, PRIORITY, 2)]
    settings.remove(UID)
    assert sorted(settle(settings), key=str) == sorted([(UID, WEIGHT, None), (UID, PRIORITY, None)], key=str)


def test_a_bad_value_removes_the_setting_and_is_reported_once_while_it_stays():
    settings = PodSettings()
    settings.update(read_pod(pod({WEIGHT: "4"})))
    settle(settings)
    problems = settings.update(read_pod(pod({WEIGHT: "four"})))
    assert [problem.value for problem in problems] == ["four"]
    assert settle(settings) == [(UID, WEIGHT, None)]
    assert settings.update(read_pod(pod({WEIGHT: "four", "other": "x"}))) == []
    settings.update(read_pod(pod({WEIGHT: "4"})))
    assert settle(settings) == [(UID, WEIGHT, 4)]
    assert len(settings.update(read_pod(pod({WEIGHT: "four"})))) == 1  # back again: said again


def test_a_fresh_list_removes_the_pods_that_are_gone_and_a_new_scheduler_gets_everything():
    settings = PodSettings()
    settings.replace_all([read_pod(pod({WEIGHT: "2"})), read_pod(pod({PRIORITY: "1"}, uid=OTHER, name="nb-1"))])
    assert len(settle(settings)) == 2
    settings.replace_all([read_pod(pod({PRIORITY: "1"}, uid=OTHER, name="nb-1"))])
    assert settle(settings) == [(UID, WEIGHT, None)]
    settings.scheduler_restarted()
    assert settle(settings) == [(OTHER, PRIORITY, 1)]
    # A pod that is gone has nothing to remove in a scheduler that never had it.
    settings.remove(OTHER)
    settings.scheduler_restarted()
    assert settle(settings) == []


def test_requests_not_yet_answered_are_pending_again():
    settings = PodSettings()
    settings.update(read_pod(pod({WEIGHT: "2"})))
    assert [r.value for r in settings.pending()] == [2]
    assert [r.value for r in settings.pending()] == [2]  # nothing is assumed sent until told()
