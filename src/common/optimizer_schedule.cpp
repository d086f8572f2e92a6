#include "tidal/common/optimizer_schedule.hpp"

#include "tidal/common/enum_names.hpp"

namespace tidal {

namespace {

constexpr EnumName<OptimizerSchedule> kScheduleNames[] = {
    {OptimizerSchedule::kAfterBackward, "after-backward"},
    {OptimizerSchedule::kInBackward, "in-backward"},
    {OptimizerSchedule::kDeferred, "deferred"},
};

}  // namespace

const char* to_string(OptimizerSchedule s) { return enum_name(kScheduleNames, s); }

OptimizerSchedule optimizer_schedule_from_string(const std::string& s) {
  return enum_value(kScheduleNames, s, "optimizer schedule");
}

}  // namespace tidal
