// The student group's notes board (GroupNotes, student_group.h): keys posted,
// awaited and erased over a connection of its own to the rendezvous store.
#include <algorithm>
#include <string>
#include <vector>

#include "student_group_impl.h"

namespace distill {

// ---- notes ----

struct GroupNotes::Impl {
  c10::intrusive_ptr<c10d::Store> store; // a clone: its own connection

  // `doing` is "posting", "awaiting", ...; `what` names the note(s).
  [[noreturn]] static void lost(const std::string& doing, const std::string& what, const std::exception& e) {
    DISTILL_THROW(PeerLostError, doing == "awaiting" ? awaiting("student group note " + what) : ErrorWhere{},
                  "student group notes: lost the rendezvous store (served by student rank 0) while ", doing, " ", what,
                  ": ", firstLineOf(e.what()));
  }
};

GroupNotes::GroupNotes() : impl_(std::make_unique<Impl>()) {}
GroupNotes::~GroupNotes() = default;

void GroupNotes::post(const std::string& key, const std::string& value) {
  try {
    impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    Impl::lost("posting", key, e);
  }
}

std::vector<std::optional<std::string>> GroupNotes::await(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::optional<std::string>> out(keys.size());
  if (keys.empty()) return out;
  bool all = false;
  try {
    // The server answers when the last key is set: no polling.
    impl_->store->wait(keys, std::max(timeout, Millis(1)));
    all = true;
  } catch (const std::exception&) {
    // A timeout, or the store gone: check() below tells which.
  }
  try {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!all && !impl_->store->check({keys[i]})) continue;
      auto v = impl_->store->get(keys[i]);
      out[i] = std::string(v.begin(), v.end());
    }
  } catch (const std::exception& e) {
    Impl::lost("awaiting", keys.front() + (keys.size() > 1 ? " and " + std::to_string(keys.size() - 1) + " more" : ""),
               e);
  }
  return out;
}

void GroupNotes::erase(const std::string& key) {
  try {
    impl_->store->deleteKey(key);
  } catch (const std::exception& e) {
    Impl::lost("removing", key, e);
  }
}

std::unique_ptr<GroupNotes> StudentGroup::notes(const std::string& prefix) {
  std::unique_ptr<GroupNotes> n(new GroupNotes());
  try {
    n->impl_->store = c10::make_intrusive<c10d::PrefixStore>("notes/" + prefix, impl_->store->clone());
  } catch (const std::exception& e) {
    GroupNotes::Impl::lost("connecting for", "notes " + prefix, e);
  }
  n->impl_->store->setTimeout(impl_->timeout);
  return n;
}

} // namespace distill
