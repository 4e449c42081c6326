"""softq.calib"""
